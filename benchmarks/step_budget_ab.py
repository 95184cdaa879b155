"""The engine step's default token budget on a CPU against the old fixed 2048, served, side by side.

    python benchmarks/step_budget_ab.py [--models smollm2-135m-instruct tiny] [--streams 4 16] [--rounds 2]

`tandem up` with its defaults (the budget sized by the model's FLOPs, common/scheduler/step_budget.py:
256 tokens for SmolLM2-135M, 2048 for the tiny model) and with `--max-num-batched-tokens 2048`,
started in turn, A B then B A, each driven by guidellm (closed-loop streams, 128-token prompts,
64-token outputs) at every level; the same fresh prompts for both at a level and round. Reported:
output tok/s, TTFT p50 and ITL p50 of each, and the default's ratio to 2048 (medians over rounds).
Needs guidellm (benchmarks/serve_vs_peers.py --install-only).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_common import RESULTS, machine_info, print_table, write_result
from peer_install import PeerPaths
from serve_vs_peers import Running, free_port, level_seed, resolve_model, tandem_server
from stream_load import run_guidellm

NAME = "step_budget_ab"
WAYS = {"default": [], "2048": ["--max-num-batched-tokens", "2048"]}


def one_server(model, way: str, streams: list[int], args, round_: int) -> dict[int, dict]:
    port = free_port()
    prefix = args.log_dir / f"{NAME}-{model.label}-{way}-r{round_}"
    running = Running(tandem_server(model, port, WAYS[way]), port, prefix.with_suffix(".log"))
    try:
        running.wait_ready()
        out = {}
        for s in streams:
            lv = run_guidellm(args.peers.guidellm, running.url, model.path, s, args.duration, 128, 64, prefix,
                              level_seed(args.seed + 100 * round_, s))  # fmt: skip
            print(f"   {model.label} {way:>8} round {round_} {s:>2} stream(s): {lv.output_tok_s:.1f} tok/s, "
                  f"TTFT p50 {lv.ttft_p50_ms:.1f} ms, ITL p50 {lv.itl_p50_ms:.2f} ms", flush=True)  # fmt: skip
            out[s] = lv.to_dict()
        return out
    finally:
        running.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "tiny"])
    ap.add_argument("--streams", nargs="+", type=int, default=[4, 16])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    args.peers = PeerPaths.default()
    args.log_dir = RESULTS  # server logs and guidellm's raw reports: git-ignored there
    started = time.time()
    runs: dict[str, dict[str, list[dict[int, dict]]]] = {}
    for name in args.models:
        model = resolve_model(name)
        runs[model.label] = {way: [] for way in WAYS}
        for r in range(args.rounds):
            order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                runs[model.label][way].append(one_server(model, way, args.streams, args, r))
    rows, table_rows = [], []
    for label, ways in runs.items():
        for s in args.streams:
            med = {way: {k: statistics.median(run[s][k] for run in ways[way]) for k in
                         ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")} for way in WAYS}  # fmt: skip
            ratio = {k: med["default"][k] / med["2048"][k] for k in med["default"]}
            rows.append({"model": label, "streams": s, "medians": med, "default_over_2048": ratio,
                         "rounds": {way: [run[s] for run in ways[way]] for way in WAYS}})  # fmt: skip
            table_rows.append([label, s, *(f"{med[w]['output_tok_s']:.1f} | {med[w]['ttft_p50_ms']:.0f} | "
                                           f"{med[w]['itl_p50_ms']:.1f}" for w in WAYS),
                               f"{ratio['output_tok_s']:.2f}x | {ratio['ttft_p50_ms']:.2f}x | {ratio['itl_p50_ms']:.2f}x"])
    table = print_table(
        f"Step budget: default (sized by FLOPs on CPU) vs 2048 tokens, `tandem up`, guidellm, {args.duration:g} s "
        f"levels, medians of {args.rounds} rounds (tok/s \\| TTFT p50 ms \\| ITL p50 ms)",
        ["model", "streams", "default", "2048", "default / 2048"], table_rows)  # fmt: skip
    write_result(NAME, {"machine": machine_info(), "rows": rows, "table": table, "started": started,
                        "duration_s": args.duration, "rounds": args.rounds})  # fmt: skip


if __name__ == "__main__":
    main()
