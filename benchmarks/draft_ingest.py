"""What a draft model's ingestion of new prompts costs: one pass against passes of the fused decoder.

A draft's start makes it ingest the request's prompt, a prefill on the draft's device; four
prompts arriving together are one call of ~180 tokens. With the draft's weights stored in bf16
(`--draft-weight-dtype bfloat16`), a pass past the fused CPU decoder's crossover went to PyTorch's
layers, which widen every matrix into a float32 copy per pass; ModelRunner now cuts such a step
into passes the fused decoder takes (model_runner.split_passes). Both, in the same run, alternating:

    .venv/bin/python benchmarks/draft_ingest.py [--model qwen2.5-coder-0.5b-instruct]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from bench_common import bench_model, print_table, write_result
from common.spec_decode.draft_worker import DraftUpdate, DraftWorker, DraftWorkerConfig


def ingest_seconds(worker: DraftWorker, prompts: list[list[int]], tag: str) -> float:
    """One propose call that makes the draft ingest every prompt and draft 3 tokens each."""
    updates = [DraftUpdate(f"{tag}-{i}", 0, True, 0, p, len(p), 3) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    worker.propose(updates)
    seconds = time.perf_counter() - t0
    worker.release(request_ids=[u.request_id for u in updates])
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--weight-dtype", default="bfloat16", choices=("auto", "bfloat16"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="draft_ingest")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    worker = DraftWorker(DraftWorkerConfig(model=str(bench_model(args.model)), weight_dtype=args.weight_dtype,
                                           num_kv_blocks=1024))  # fmt: skip
    limits = worker.runner.max_pass_tokens  # what the runner chose for this model and build
    rng = random.Random(0)
    ingest_seconds(worker, [[rng.randrange(1000, 30000) for _ in range(40)]], "warm")
    rows, results = [], []
    for n, length in ((1, 44), (2, 44), (4, 44), (8, 44), (4, 128)):
        timings: dict[str, list[float]] = {"one pass": [], "passes": []}
        for rep in range(args.repeats):
            prompts = [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]
            for arm in (("one pass", "passes") if rep % 2 == 0 else ("passes", "one pass")):
                worker.runner.max_pass_tokens = None if arm == "one pass" else limits
                timings[arm].append(ingest_seconds(worker, prompts, f"{arm}-{n}-{length}-{rep}"))
        one, split = statistics.median(timings["one pass"]), statistics.median(timings["passes"])
        tokens = n * length
        results.append(dict(prompts=n, prompt_tokens=length, tokens=tokens, one_pass_s=one, passes_s=split,
                            speedup=one / split, runs={k: [round(x, 4) for x in v] for k, v in timings.items()}))  # fmt: skip
        rows.append([n, length, tokens, one, split, one / split, split / tokens * 1000])
        print(results[-1], flush=True)
    worker.runner.max_pass_tokens = limits
    table = print_table(
        f"Draft ingestion ({args.model}, weights {args.weight_dtype}, {args.threads} threads): one call that ingests "
        f"n prompts and drafts 3 tokens each, one model pass vs passes of <= {limits and limits[0]} tokens "
        f"(the fused decoder's limit), median of {args.repeats}, alternating",
        ["prompts", "tokens each", "tokens", "one pass s", "passes s", "speedup", "ms/token (passes)"], rows)  # fmt: skip
    print(f"wrote {write_result(args.name, dict(model=args.model, weight_dtype=args.weight_dtype, threads=args.threads, pass_limits=limits, results=results, table=table))}")


if __name__ == "__main__":
    main()
