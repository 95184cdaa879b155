"""A long CPU step as fused passes or as one pass of PyTorch's layers, quiet and beside a busy core.

    python benchmarks/split_passes_ab.py [--model smollm2-135m-instruct] [--prompts 4] [--pairs 4]

LLMEngine.step() over waves of `--prompts` fresh 128-token prompts (the default step budget, 256
tokens for SmolLM2), the model runner's pass limits switched between the waves, alternating which
goes first: fused passes of at most cpu_decoder.max_tokens() tokens (what SPLITS_FLOAT32_STEPS
picks) against one pass over PyTorch's layers (MKL). Run twice: on a quiet machine, and with a
busy loop in another process holding one of the cores, as the gateway and the client do in
service (MKL's OpenMP regions wait at each barrier for the thread that lost its core; the fused
passes' threads claim chunks). Writes benchmarks/results/<--name>.json and a table.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench_model, machine_info, model_label, print_table, write_result  # noqa: E402
from serving_overhead import alone_engine, prompts_for  # noqa: E402

from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.kernels import cpu_decoder  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def wave_ms(engine: LLMEngine, prompts, limits: tuple[int, int] | None) -> float:
    """Every step of one wave of prompts (to their first tokens) with these pass limits."""
    engine.runner.max_pass_tokens = limits
    for prompt in prompts:
        engine.add_request(f"w{time.perf_counter_ns()}", prompt_token_ids=prompt, params=FIRST_TOKEN)
    took = 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        took += time.perf_counter() - t0
    return took * 1e3


def paired(engine: LLMEngine, prompts: Iterator[list[int]], n: int, pairs: int, fused: tuple[int, int]) -> dict:
    times: dict[str, list[float]] = {"fused passes": [], "one PyTorch pass": []}
    for i in range(pairs):
        ways = [("fused passes", fused), ("one PyTorch pass", None)]
        for name, limits in ways if i % 2 == 0 else ways[::-1]:
            times[name].append(wave_ms(engine, [next(prompts) for _ in range(n)], limits))
    ratios = [p / f for f, p in zip(times["fused passes"], times["one PyTorch pass"])]
    return {"times_ms": times, "pytorch_over_fused": ratios, "median_ratio": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=4, help="128-token prompts a wave")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="split_passes_ab")
    args = ap.parse_args()
    path = bench_model(args.model)
    engine = alone_engine(path, args.threads)
    fused = (cpu_decoder.max_tokens(False), cpu_decoder.max_tokens(True))
    if not fused[0]:
        raise SystemExit(f"no fused CPU decoder here ({cpu_decoder.unavailable_reason()})")
    prompts = iter(prompts_for(path, 4 * args.prompts * args.pairs + 2 * args.prompts, seed=11))
    wave_ms(engine, [next(prompts) for _ in range(args.prompts)], fused)  # warm-up
    results = {"quiet": paired(engine, prompts, args.prompts, args.pairs, fused)}
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        results["beside a busy core"] = paired(engine, prompts, args.prompts, args.pairs, fused)
    finally:
        busy.kill()
    rows = [[model_label(args.model), when, f"{statistics.median(r['times_ms']['fused passes']):.0f}",
             f"{statistics.median(r['times_ms']['one PyTorch pass']):.0f}", f"{r['median_ratio']:.2f}x"]
            for when, r in results.items()]  # fmt: skip
    table = print_table(
        f"A step budget's worth of prompts ({args.prompts} x 128 tokens, budget "
        f"{engine.config.scheduler.max_num_batched_tokens}): fused passes of <= {fused[0]} tokens vs one PyTorch "
        f"pass, {args.threads} threads, {args.pairs} alternating pairs (median ms a wave)",
        ["model", "machine", "fused passes", "one PyTorch pass", "PyTorch / fused (paired median)"], rows)  # fmt: skip
    write_result(args.name, {"machine": machine_info(), "cpu_build": cpu_decoder._variant(),
                             "budget": engine.config.scheduler.max_num_batched_tokens, "fused_limits": fused,
                             "results": results, "table": table})  # fmt: skip


if __name__ == "__main__":
    main()
