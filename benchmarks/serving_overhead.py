"""What the cluster costs over its own engine, at one stream (issue 10's third goal).

    python benchmarks/serving_overhead.py [--models tiny smollm2-135m-instruct] [--requests 12] [--rounds 3]

For each model, in one run on one machine, in rounds that alternate (engine then cluster, cluster
then engine, ...), with both kept up throughout (the one not measured sits idle):
1. the engine in this process, with the torch threads `tandem up` gives its decode worker: the
   prefill time of a fresh 128-token prompt and the median decode step at batch 1 (64 tokens);
2. `tandem up` with its defaults (aggregated, auto threads), the same prompts as token ids over
   /v1/completions, streamed one request at a time: TTFT p50 and ITL p50 at the client (a
   request's ITL as guidellm's: first token to last over the 63 gaps between them).
Each round's ratios, and their medians, are reported: this machine's speed drifts by 10-30% from
one minute to the next (the engine alone stepped SmolLM2 in 18.5 ms, then 15.1 ms a minute
later), so an engine phase and a cluster phase run once each, one after the other, measured the
drift as much as the cluster. Targets: ITL <= 1.15x the engine's step, TTFT <= 1.2x (prefill +
one step).
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


def alone_engine(path: Path, threads: int) -> LLMEngine:
    """The engine in this process, on the torch threads `tandem up` gives its decode worker."""
    torch.set_num_threads(threads)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"), detokenize=False)


def served_cluster(path: Path):
    """`tandem up`'s defaults (aggregated, auto threads) on this model, as a context manager."""
    return start_cluster(str(path), mode="aggregated", torch_threads=AUTO_THREADS, http_port=0, grpc_port=0,
                         startup_timeout_s=600)


def engine_times(path: Path, prompts: list[list[int]], threads: int) -> tuple[float, float]:
    """(prefill ms, median decode step ms) of the engine alone, batch 1 (a fresh engine)."""
    engine = alone_engine(path, threads)
    try:
        return engine_steps(engine, prompts, warm_up=True)
    finally:
        del engine
        gc.collect()


def engine_steps(engine: LLMEngine, prompts: list[list[int]], warm_up: bool) -> tuple[float, float]:
    """(prefill ms, median decode step ms) of these prompts on this engine, one at a time."""
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
    return statistics.median(prefills[1:] if warm_up else prefills) * 1e3, statistics.median(steps) * 1e3


def served_times(path: Path, prompts: list[list[int]]) -> tuple[float, float, float]:
    """(TTFT p50 ms, ITL p50 ms, output tok/s) of `tandem up`'s defaults, one stream (a fresh cluster)."""
    import httpx

    with served_cluster(path) as cluster, httpx.Client(timeout=600) as client:
        return served_requests(client, cluster.http_url, path, prompts, warm_up=True)


def served_requests(client, url: str, path: Path, prompts: list[list[int]], warm_up: bool) -> tuple[float, float, float]:
    """(TTFT p50 ms, ITL p50 ms, output tok/s) of these prompts streamed one at a time from url."""
    ttfts, itls, tokens = [], [], 0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if i == 1 and warm_up:
            start = time.perf_counter()  # the first request warms up
        body = {"model": path.name, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        sent = time.perf_counter()
        arrivals = []
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"]:
                        arrivals.append(time.perf_counter())
        if i == 0 and warm_up:
            continue
        tokens += OUTPUT_LEN
        ttfts.append(arrivals[0] - sent)
        # Per request, as guidellm counts it: the first token to the last over the gaps between
        # tokens (a message may carry several: the decode worker's --stream-interval-ms).
        itls.append((arrivals[-1] - arrivals[0]) / (OUTPUT_LEN - 1))
    wall = time.perf_counter() - start
    return statistics.median(ttfts) * 1e3, statistics.median(itls) * 1e3, tokens / wall


def measure_model(name: str, requests: int, rounds: int) -> dict:
    """Engine and cluster in alternating rounds; each round's figures and ratios, and the medians."""
    import httpx

    path = bench_model(name)
    threads = ClusterSpec(model=str(path), mode="aggregated", torch_threads=AUTO_THREADS).threads_per_engine()
    engine = alone_engine(path, threads)
    per_round = []
    with served_cluster(path) as cluster, httpx.Client(timeout=600) as client:
        for k in range(rounds):
            prompts = prompts_for(path, requests, seed=1 + k)  # distinct in every round: no prefix-cache hits
            parts = {}
            for phase in ("engine", "cluster") if k % 2 == 0 else ("cluster", "engine"):
                if phase == "engine":
                    parts["engine"] = engine_steps(engine, prompts, warm_up=k == 0)
                else:
                    parts["cluster"] = served_requests(client, cluster.http_url, path, prompts, warm_up=k == 0)
            (prefill_ms, step_ms), (ttft_ms, itl_ms, tok_s) = parts["engine"], parts["cluster"]
            r = dict(engine_prefill_ms=prefill_ms, engine_step_ms=step_ms, ttft_p50_ms=ttft_ms, itl_p50_ms=itl_ms,
                     output_tok_s=tok_s, itl_ratio=itl_ms / step_ms, ttft_ratio=ttft_ms / (prefill_ms + step_ms))  # fmt: skip
            print(f"{model_label(name)} round {k + 1}: {r}", flush=True)
            per_round.append(r)
    del engine
    gc.collect()
    med = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    return dict(model=model_label(name), threads=threads, rounds=per_round, **med)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--requests", type=int, default=12, help="requests per model and round (the first round's first warms up)")
    ap.add_argument("--rounds", type=int, default=3, help="engine / cluster rounds, their order turned each round")
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models:
        r = measure_model(name, args.requests, args.rounds)
        results.append(r)
        each = " / ".join(f"{x['itl_ratio']:.2f}" for x in r["rounds"])
        each_ttft = " / ".join(f"{x['ttft_ratio']:.2f}" for x in r["rounds"])
        rows.append([r["model"], r["threads"], r["engine_prefill_ms"], r["engine_step_ms"], r["ttft_p50_ms"],
                     r["itl_p50_ms"], f"{r['ttft_ratio']:.2f} ({each_ttft})", f"{r['itl_ratio']:.2f} ({each})",
                     r["output_tok_s"]])  # fmt: skip
    table = print_table(
        f"What `tandem up` (aggregated, auto threads) costs over its own engine at one stream: "
        f"{PROMPT_LEN}-token prompts (distinct, so no prefix-cache hits), {OUTPUT_LEN} output tokens, streamed; "
        f"{args.rounds} rounds (engine and cluster alternating), medians, each round's ratio in brackets; "
        f"targets TTFT <= 1.2x (prefill + one step), ITL <= 1.15x the step",
        ["model", "threads", "engine prefill ms", "engine step ms", "TTFT p50 ms", "ITL p50 ms",
         "TTFT / (prefill + step)", "ITL / step", "tok/s"], rows)  # fmt: skip
    write_result("serving_overhead", {"results": results, "table": table})


if __name__ == "__main__":
    main()
