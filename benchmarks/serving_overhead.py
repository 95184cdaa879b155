"""What the cluster costs over its own engine, at one stream (issue 10's third goal).

    python benchmarks/serving_overhead.py [--models tiny smollm2-135m-instruct] [--requests 12]

For each model, in one run on one machine:
1. the engine in this process, with the torch threads `tandem up` gives its decode worker: the
   prefill time of a fresh 128-token prompt and the median decode step at batch 1 (64 tokens);
2. `tandem up` with its defaults (aggregated, auto threads), the same prompts as token ids over
   /v1/completions, streamed one request at a time: TTFT p50 and ITL p50 at the client (a
   request's ITL as guidellm's: first token to last over the 63 gaps between them).
Targets: ITL <= 1.15x the engine's step, TTFT <= 1.2x (prefill + one step).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, vocab_size, write_result  # noqa: E402
from common.config import EngineConfig  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402
from services.launcher.cluster import AUTO_THREADS, ClusterSpec, start_cluster  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 128, 64


def prompts_for(path: Path, n: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (no prefix-cache hits), ids away from the special tokens."""
    rng = random.Random(seed)
    vocab = vocab_size(path)
    return [[rng.randrange(vocab // 10, vocab - 10) for _ in range(PROMPT_LEN)] for _ in range(n)]


def engine_times(path: Path, prompts: list[list[int]], threads: int) -> tuple[float, float]:
    """(prefill ms, median decode step ms) of the engine alone, batch 1."""
    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"), detokenize=False)
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    prefills, steps = [], []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt_token_ids=prompt, params=params)
        t0 = time.perf_counter()
        engine.step()  # the whole prompt (within the step budget) and the first token
        prefills.append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
    del engine
    gc.collect()
    return statistics.median(prefills[1:]) * 1e3, statistics.median(steps) * 1e3  # the first warms up


def served_times(path: Path, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(TTFT p50 ms, ITL p50 ms, output tok/s) of `tandem up`'s defaults, one stream."""
    import httpx

    with start_cluster(str(path), mode="aggregated", torch_threads=AUTO_THREADS, http_port=0, grpc_port=0,
                       startup_timeout_s=600) as cluster, httpx.Client(timeout=600) as client:  # fmt: skip
        ttfts, itls, tokens = [], [], 0
        start = None
        for i, prompt in enumerate(prompts):
            if i == 1:
                start = time.perf_counter()  # the first request warms up
            body = {"model": path.name, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            sent = time.perf_counter()
            arrivals = []
            with client.stream("POST", cluster.http_url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:])["choices"]:
                            arrivals.append(time.perf_counter())
            if i == 0:
                continue
            tokens += OUTPUT_LEN
            ttfts.append(arrivals[0] - sent)
            # Per request, as guidellm counts it: the first token to the last over the gaps between
            # tokens (a message may carry several: the decode worker's --stream-interval-ms).
            itls.append((arrivals[-1] - arrivals[0]) / (OUTPUT_LEN - 1))
        wall = time.perf_counter() - start
    return statistics.median(ttfts) * 1e3, statistics.median(itls) * 1e3, tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--requests", type=int, default=12, help="requests per model (the first warms up)")
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models:
        path = bench_model(name)
        prompts = prompts_for(path, args.requests, seed=1)
        threads = ClusterSpec(model=str(path), mode="aggregated", torch_threads=AUTO_THREADS).threads_per_engine()
        prefill_ms, step_ms = engine_times(path, prompts, threads)
        ttft_ms, itl_ms, tok_s = served_times(path, prompts)
        r = dict(model=model_label(name), threads=threads, engine_prefill_ms=prefill_ms, engine_step_ms=step_ms,
                 ttft_p50_ms=ttft_ms, itl_p50_ms=itl_ms, output_tok_s=tok_s, itl_ratio=itl_ms / step_ms,
                 ttft_ratio=ttft_ms / (prefill_ms + step_ms))  # fmt: skip
        results.append(r)
        print(r, flush=True)
        rows.append([r["model"], threads, prefill_ms, step_ms, ttft_ms, itl_ms, r["ttft_ratio"], r["itl_ratio"], tok_s])
    table = print_table(
        f"What `tandem up` (aggregated, auto threads) costs over its own engine at one stream: "
        f"{PROMPT_LEN}-token prompts (distinct, so no prefix-cache hits), {OUTPUT_LEN} output tokens, streamed; "
        f"targets TTFT <= 1.2x (prefill + one step), ITL <= 1.15x the step",
        ["model", "threads", "engine prefill ms", "engine step ms", "TTFT p50 ms", "ITL p50 ms",
         "TTFT / (prefill + step)", "ITL / step", "tok/s"], rows)  # fmt: skip
    write_result("serving_overhead", {"results": results, "table": table})


if __name__ == "__main__":
    main()
