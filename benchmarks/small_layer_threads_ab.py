"""A small model's decode steps on every thread or on one (cpu_decoder.PARALLEL_SMALL_DECODE_MIN_TOKENS).

    python benchmarks/small_layer_threads_ab.py [--model tiny] [--batches 1 4 16] [--pairs 8]

LLMEngine.step() of decode-only batches (32-token prompts ingested first, then 40 decode steps; the
median step), the setting switched between batches of requests, alternating which goes first, in one
process on `--threads` torch threads: drift falls on both alike. Models under
MIN_PARALLEL_LAYER_FLOATS a layer step on one thread unless their build is listed in
PARALLEL_SMALL_LAYERS (wide steps; narrow ones, decode, from PARALLEL_SMALL_DECODE_MIN_TOKENS
tokens); this measures what a second thread buys each batch's decode steps on this CPU, alone. Writes
benchmarks/results/<--name>.json and a table. The served effect is serve_ab.py's to measure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import bench_model, machine_info, model_label, print_table, write_result  # noqa: E402
from serving_overhead import alone_engine, prompts_for  # noqa: E402

from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.kernels import cpu_decoder  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402

DECODE_STEPS = 40
PROMPT_TOKENS = 32


def every_thread(on: bool) -> None:
    """Sets what cpu_decoder reads as this build's PARALLEL_SMALL_LAYERS and
    PARALLEL_SMALL_DECODE_MIN_TOKENS entries (their cached lookups): decode steps on every thread, or on one."""
    cpu_decoder._parallel_small_layers = lambda: on
    cpu_decoder._parallel_small_decode_min_tokens = lambda: 1 if on else cpu_decoder.WIDE_MIN_TOKENS


def decode_step_ms(engine: LLMEngine, prompts, ids, batch: int) -> float:
    """Median decode step of `batch` fresh requests (their prompts ingested first, not timed)."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 4, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(f"r{next(ids)}", prompt_token_ids=next(prompts)[:PROMPT_TOKENS], params=params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in scheduler.running):
        engine.step()  # the prompts
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[:-1]) * 1e3  # the last step finishes every request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="small_layer_threads_ab")
    args = ap.parse_args()
    path = bench_model(args.model)
    engine = alone_engine(path, args.threads)
    if not cpu_decoder.available():
        raise SystemExit(f"no fused CPU decoder here ({cpu_decoder.unavailable_reason()})")
    layer_floats = engine.model_config.layer_weights
    if layer_floats >= cpu_decoder.MIN_PARALLEL_LAYER_FLOATS:
        raise SystemExit(f"{args.model}'s layers ({layer_floats} floats) take every thread on any build")
    builds = cpu_decoder._parallel_small_layers, cpu_decoder._parallel_small_decode_min_tokens
    listed = cpu_decoder._parallel_small_decode_min_tokens() if cpu_decoder._parallel_small_layers() else None
    prompts = iter(prompts_for(path, 2 * args.pairs * sum(args.batches) + max(args.batches), seed=5))
    ids = count()
    decode_step_ms(engine, prompts, ids, max(args.batches))  # warm-up
    results, rows = {}, []
    for batch in args.batches:
        times: dict[str, list[float]] = {"every thread": [], "one thread": []}
        for i in range(args.pairs):
            ways = [("every thread", True), ("one thread", False)]
            for name, on in ways if i % 2 == 0 else ways[::-1]:
                every_thread(on)
                times[name].append(decode_step_ms(engine, prompts, ids, batch))
        ratios = [one / every for every, one in zip(times["every thread"], times["one thread"])]
        results[batch] = {"times_ms": times, "one_over_every": ratios, "median_ratio": statistics.median(ratios)}
        rows.append([model_label(args.model), batch, f"{statistics.median(times['every thread']):.3f}",
                     f"{statistics.median(times['one thread']):.3f}", f"{statistics.median(ratios):.2f}x"])  # fmt: skip
    cpu_decoder._parallel_small_layers, cpu_decoder._parallel_small_decode_min_tokens = builds  # as built again
    table = print_table(
        f"Decode steps of a small model ({layer_floats} floats a layer): its layers on {args.threads} threads vs "
        f"one, {args.pairs} alternating pairs (median ms a step; this build {cpu_decoder._variant()} takes every "
        f"thread from {listed or 'no'} decode tokens)",
        ["model", "batch", "every thread", "one thread", "one / every (paired median)"], rows)  # fmt: skip
    write_result(args.name, {"machine": machine_info(), "cpu_build": cpu_decoder._variant(),
                             "every_thread_from_tokens": listed, "layer_floats": layer_floats, "results": results,
                             "table": table})  # fmt: skip


if __name__ == "__main__":
    main()
