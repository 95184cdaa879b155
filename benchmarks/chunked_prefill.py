"""Chunked prefill keeps decodes flowing: the longest inter-token gap of running requests when a
long prompt arrives, with and without chunking.

16 requests decode; once they are all running, a 4,000-token prompt is injected. We record each
step's wall time and, for every running request, the time between its consecutive tokens.

    python benchmarks/chunked_prefill.py [--size small] [--chunk-budget 48]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench_common import bench_model, model_label, print_table, write_result
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams


def run(path, budget: int, long_len: int, decode_tokens: int) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=str(path), dtype="float32", device="cpu",
            cache=CacheConfig(num_kv_blocks=(long_len + 16 * (decode_tokens + 80)) // 16 + 64),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64),
        ),
        detokenize=False,
    )  # fmt: skip
    rng = random.Random(0)
    for i in range(16):
        prompt = [rng.randrange(8, 1000) for _ in range(rng.randint(16, 64))]
        engine.add_request(f"d{i}", params=SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True),
                           prompt_token_ids=prompt)  # fmt: skip
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    last_token_time: dict[str, float] = {}
    gaps: list[float] = []
    steps: list[float] = []
    step_tokens: list[int] = []
    injected = False
    long_done_at = None
    n = 0
    while engine.has_unfinished_requests():
        if not injected and n == 5:
            long_prompt = [rng.randrange(8, 1000) for _ in range(long_len)]
            engine.add_request("long", params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               prompt_token_ids=long_prompt)  # fmt: skip
            injected = True
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        steps.append(t1 - t0)
        step_tokens.append(engine.last_step.num_tokens)
        n += 1
        for o in outs:
            if o.request_id == "long":
                long_done_at = long_done_at or t1
                continue
            if o.request_id in last_token_time:
                gaps.append(t1 - last_token_time[o.request_id])
            last_token_time[o.request_id] = t1
        if long_done_at and all(r.request_id == "long" for r in engine.scheduler.running):
            break
    median = statistics.median(steps)
    gaps.sort()
    slowest = sorted(zip(steps, step_tokens), reverse=True)[:5]
    return {"budget": budget, "median_step_s": median, "max_gap_s": gaps[-1], "max_gap_over_median_step": gaps[-1] / median,
            "p99_gap_over_median_step": gaps[int(0.99 * (len(gaps) - 1))] / median,
            "slowest_steps": [{"seconds": t, "tokens": n} for t, n in slowest], "steps": len(steps)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", help="tiny / small (random llama) or a tandem fetch-model name")
    ap.add_argument("--name", default="chunked_prefill", help="result file name (benchmarks/results/NAME.json)")
    ap.add_argument("--chunk-budget", type=int, default=48, help="token budget per step with chunking")
    ap.add_argument("--long-len", type=int, default=4000)
    ap.add_argument("--decode-tokens", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(2)
    path = bench_model(args.size)
    chunked = run(path, args.chunk_budget, args.long_len, args.decode_tokens)
    whole = run(path, args.long_len + 64, args.long_len, args.decode_tokens)
    table = print_table(
        f"Inter-token gap of 16 decoding requests when a {args.long_len}-token prompt arrives ({model_label(args.size)})",
        ["mode", "token budget", "median step (s)", "longest gap (s)", "gap / median step"],
        [["chunked prefill", chunked["budget"], chunked["median_step_s"], chunked["max_gap_s"], chunked["max_gap_over_median_step"]],
         ["no chunking", whole["budget"], whole["median_step_s"], whole["max_gap_s"], whole["max_gap_over_median_step"]]],
    )  # fmt: skip
    write_result(args.name, {"model": model_label(args.size), "chunked": chunked, "unchunked": whole,
                                     "table": table, "target": "chunked max_gap_over_median_step <= 2"})  # fmt: skip


if __name__ == "__main__":
    main()
