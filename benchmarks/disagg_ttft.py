"""TTFT added by disaggregation: a long prompt through a disaggregated cluster (prefill worker
computes, KV ships over gRPC to decode) vs an aggregated one (decode prefills itself).

Both clusters are real processes started by the launcher on the same model and engine settings.
TTFT is measured by the client: POST /v1/completions (stream) until the first token arrives.
Added TTFT as a share of the aggregated prefill time is the cost of moving the KV: transfer of
each chunk overlaps the computation of the next, so only the last chunk's transfer should show.

    python benchmarks/disagg_ttft.py [--size small] [--prompt-len 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx

from bench_common import bench_model, model_label, print_table, write_result
from services.launcher.cluster import start_cluster


def ttft(url: str, prompt: list[int]) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    return time.perf_counter() - start
    raise RuntimeError("stream ended without a token")


def measure(model, mode: str, prompts: list[list[int]], engine_args: list[str]) -> list[float]:
    # The machine's cores go to whoever computes the prompt: decode in aggregated mode, the
    # prefill worker in disaggregated mode (decode then only receives KV: one thread is plenty).
    service_args = {"decode": ["--torch-threads", "1"]} if mode == "disaggregated" else {}
    with start_cluster(model, mode=mode, http_port=0, grpc_port=0, extra_args=engine_args,
                       torch_threads=2, service_args=service_args, startup_timeout_s=600) as c:  # fmt: skip
        ttft(c.http_url, prompts[0][:64])  # warm up
        return [ttft(c.http_url, p) for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", help="tiny / small (random llama) or a tandem fetch-model name")
    ap.add_argument("--name", default="disagg_ttft", help="result file name (benchmarks/results/NAME.json)")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk / token budget")
    args = ap.parse_args()
    model = bench_model(args.size)
    rng = random.Random(0)
    # Distinct prompts: no prefix-cache hits between repeats.
    prompts = [[rng.randrange(8, 1000) for _ in range(args.prompt_len)] for _ in range(args.repeats)]
    engine_args = ["--max-num-batched-tokens", str(args.chunk), "--prefill-chunk-size", str(args.chunk),
                   "--dtype", "float32", "--num-kv-blocks", str(args.prompt_len // 16 * (args.repeats + 2) + 64)]  # fmt: skip
    agg = measure(model, "aggregated", prompts, engine_args)
    dis = measure(model, "disaggregated", prompts, engine_args)
    a, d = statistics.median(agg), statistics.median(dis)
    added = (d - a) / a
    table = print_table(
        f"TTFT of a {args.prompt_len}-token prompt ({model_label(args.size)}, chunks of {args.chunk})",
        ["mode", "median TTFT (s)", "runs"],
        [["aggregated (decode prefills)", a, len(agg)], ["disaggregated (prefill -> KV over gRPC -> decode)", d, len(dis)],
         ["added by disaggregation", f"{added * 100:.1f}% of prefill", ""]],
    )  # fmt: skip
    write_result(args.name, {"model": model_label(args.size), "prompt_len": args.prompt_len, "chunk": args.chunk,
                                 "aggregated_ttft_s": agg, "disaggregated_ttft_s": dis,
                                 "added_ttft_fraction_of_prefill": added, "table": table,
                                 "target": "added_ttft_fraction_of_prefill <= 0.15"})  # fmt: skip


if __name__ == "__main__":
    main()
