"""In-cache weights on the tiles or one weight row at a time, alternating in one engine (issue 10).

    python benchmarks/cached_tiles_ab.py [--model tiny] [--batches 1 2 4] [--pairs 30]

A model whose layers fit in cache (cpu_decoder.CACHED_WEIGHT_BYTES) runs its 1-, 2- and 4-row
decode steps on the register tiles where native.tiles_in_cache() says so (AMD without AVX-512),
else one weight row at a time, as streamed weights do on AMD (gemm_tiles.h). Both give the same
bits, so the choice is speed only; this times it on the CPU at hand: one engine, B greedy
sequences decoding, the fused decoder's `weights_cached` flag flipped between runs of 10 steps,
the order turned each pair. `tiles / rows` is the median of the pairs' ratios of median step
times (> 1: the tiles are slower here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from benchmarks.serving_overhead import alone_engine, prompts_for  # noqa: E402
from common.kernels import native  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402

STEPS = 10  # engine steps per timed run


def pairs_of(engine, batch: int, pairs: int, prompts: list[list[int]]) -> dict:
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", prompt_token_ids=prompts[i],
                           params=SamplingParams(temperature=0.0, max_tokens=2 * pairs * STEPS + 64, ignore_eos=True))  # fmt: skip
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    fused = engine.runner.model._fused
    if fused is None:
        raise RuntimeError("the fused CPU decoder did not take this model's steps")
    times: dict[int, list[float]] = {0: [], 1: []}
    ratios = []
    for p in range(pairs):
        medians = {}
        for flag in (1, 0) if p % 2 == 0 else (0, 1):
            fused.desc.weights_cached = flag
            steps = []
            for _ in range(STEPS):
                t0 = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t0)
            medians[flag] = statistics.median(steps)
            times[flag].append(medians[flag])
        ratios.append(medians[1] / medians[0])
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    return {"batch": batch, "tiles_us": 1e6 * statistics.median(times[1]), "rows_us": 1e6 * statistics.median(times[0]),
            "tiles_over_rows": statistics.median(ratios)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="cached_tiles_ab")
    args = ap.parse_args()
    path = bench_model(args.model)
    engine = alone_engine(path, args.threads)
    prompts = prompts_for(path, max(args.batches), seed=5)
    rows = [pairs_of(engine, b, args.pairs, prompts) for b in args.batches]
    table = print_table(
        f"{model_label(args.model)} decode steps, weights in cache: tiles vs one weight row at a time "
        f"(native.tiles_in_cache() = {native.tiles_in_cache()} on this CPU; {args.pairs} alternating pairs of {STEPS} steps)",
        ["batch", "tiles us", "rows in turn us", "tiles / rows (paired median)"],
        [[r["batch"], r["tiles_us"], r["rows_us"], r["tiles_over_rows"]] for r in rows],
    )
    print(f"wrote {write_result(args.name, {'model': args.model, 'threads': args.threads, 'rows': rows, 'table': table})}")


if __name__ == "__main__":
    main()
