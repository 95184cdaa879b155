"""The decode worker's streaming interval in service: `tandem up` with --stream-interval-ms 0
(every step streamed) against other values, alternating clusters in one run, one stream.

    python benchmarks/stream_interval_ab.py [--models tiny] [--intervals 0 2] [--pairs 4] [--requests 24]

Each pair starts one cluster per interval (TANDEM_STREAM_INTERVAL_MS in its environment), in
turn, and streams the same distinct 128-token prompts x 64 tokens one request at a time
(serving_overhead.served_times). Per interval: medians over the pairs of output tok/s, TTFT p50
and ITL p50 (a request's first token to its last over the gaps), and each interval's tok/s over
interval 0's in the same pair.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from benchmarks.serving_overhead import prompts_for, served_times  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny"])
    ap.add_argument("--intervals", nargs="+", type=float, default=[0.0, 2.0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24, help="requests per cluster (the first warms up)")
    ap.add_argument("--name", default="stream_interval_ab")
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models:
        path = bench_model(name)
        prompts = prompts_for(path, args.requests, seed=1)
        runs: dict[float, list[tuple[float, float, float]]] = {i: [] for i in args.intervals}
        for pair in range(args.pairs):
            order = args.intervals if pair % 2 == 0 else list(reversed(args.intervals))
            for interval in order:
                os.environ["TANDEM_STREAM_INTERVAL_MS"] = f"{interval:g}"
                runs[interval].append(served_times(path, prompts))
                print(name, pair, interval, runs[interval][-1], flush=True)
        base = runs[args.intervals[0]]
        for interval in args.intervals:
            r = runs[interval]
            ratios = [x[2] / b[2] for x, b in zip(r, base)]
            result = dict(model=model_label(name), interval_ms=interval, pairs=r,
                          ttft_p50_ms=statistics.median(x[0] for x in r), itl_p50_ms=statistics.median(x[1] for x in r),
                          output_tok_s=statistics.median(x[2] for x in r), tok_s_ratio_median=statistics.median(ratios),
                          tok_s_ratios=ratios)  # fmt: skip
            results.append(result)
            rows.append([result["model"], interval, result["ttft_p50_ms"], result["itl_p50_ms"], result["output_tok_s"],
                         result["tok_s_ratio_median"], f"{min(ratios):.2f}-{max(ratios):.2f}"])
    os.environ.pop("TANDEM_STREAM_INTERVAL_MS", None)
    table = print_table(
        f"`tandem up` by the decode worker's --stream-interval-ms, one stream, 128-token prompts x 64 tokens, "
        f"{args.pairs} alternating pairs (medians)",
        ["model", "interval ms", "TTFT p50 ms", "ITL p50 ms", "output tok/s", "tok/s / interval 0", "range"], rows)
    write_result(args.name, {"results": results, "table": table})


if __name__ == "__main__":
    main()
