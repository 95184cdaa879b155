"""Before / after a change under load: serve_vs_peers' Tandem row from two source trees, alternating.

    python benchmarks/serve_ab.py --before REV [--after REV] [--model smollm2-135m-instruct]
                                  [--streams 16] [--duration 60] [--pairs 3] [--name serve_ab]

commit_ab.py compares one stream's TTFT; this compares what guidellm sees at any concurrency. On
a shared 2-core machine a 16-stream level moves by 2x from one minute to the next (SmolLM2 at
main: 51.9 and 120.6 tok/s in two runs ten minutes apart), so each tree runs in turn, A B, B A,
A B, ..., each run its own `tandem up` (serve_vs_peers.py --servers tandem from that tree, its own
cluster, fresh prompts), and the report is the median of the pairs' after / before ratios: drift
between pairs falls on both sides alike. `--before` is checked out into a temporary git worktree;
`--after` too, or this working tree when not given. Writes benchmarks/results/<--name>.json and a
table. Needs guidellm (serve_vs_peers.py --install-only), or `--client builtin`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import machine_info, print_table, write_result  # noqa: E402
from commit_ab import source_tree  # noqa: E402

METRICS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms")


def served_row(tree: Path, args: argparse.Namespace, out: Path) -> dict:
    """One serve_vs_peers run of `tree`'s Tandem at one level; its row."""
    cmd = [sys.executable, "serve_vs_peers.py", "--servers", "tandem", "--models", args.model, "--streams",
           str(args.streams), "--duration", str(args.duration), "--client", args.client, "--no-limits",
           "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, cwd=tree / "benchmarks", check=True)
    (row,) = [r for r in json.loads(out.read_text())["rows"] if r.get("server") == "tandem"]
    return {k: row[k] for k in (*METRICS, "requests") if k in row}


def order(pairs: int) -> list[str]:
    """A B, B A, A B, ...: each side goes first in every other pair."""
    return [side for i in range(pairs) for side in (("before", "after") if i % 2 == 0 else ("after", "before"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="a commit")
    ap.add_argument("--after", default=None, help="a commit (default: this working tree)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of the level, each run")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--client", choices=("guidellm", "builtin"), default="guidellm")
    ap.add_argument("--name", default="serve_ab")
    args = ap.parse_args()
    runs: list[dict] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="serve-ab-") as tmp:
        trees = {"before": stack.enter_context(source_tree(args.before)),
                 "after": stack.enter_context(source_tree(args.after))}
        for i, side in enumerate(order(args.pairs)):
            row = served_row(trees[side], args, Path(tmp) / f"{i}-{side}.json")
            runs.append({"pair": i // 2, "side": side, **row})
            print(f"pair {i // 2} {side}: {row}", flush=True)
    pairs = [{r["side"]: r for r in runs if r["pair"] == p} for p in range(args.pairs)]
    ratios = {m: [p["after"][m] / p["before"][m] for p in pairs] for m in METRICS}
    rows = [[p, *(f"{pair['before'][m]:.1f} / {pair['after'][m]:.1f}" for m in METRICS)]
            for p, pair in enumerate(pairs)]  # fmt: skip
    rows.append(["median after / before", *(f"{statistics.median(ratios[m]):.3f}" for m in METRICS)])
    table = print_table(
        f"serve_ab: {args.model} at {args.streams} streams, {args.duration:.0f} s a run, {args.before} (before) vs "
        f"{args.after or 'the working tree'} (after), alternating",
        ["pair", "output tok/s (before / after)", "TTFT p50 ms", "ITL p50 ms"], rows)  # fmt: skip
    write_result(args.name, {"machine": machine_info(), "before": args.before, "after": args.after or "working tree",
                             "model": args.model, "streams": args.streams, "duration_s": args.duration,
                             "runs": runs, "ratios": ratios,
                             "median_ratios": {m: statistics.median(v) for m, v in ratios.items()},
                             "table": table})  # fmt: skip


if __name__ == "__main__":
    main()
