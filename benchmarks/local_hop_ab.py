"""The gateway -> decode hop on one box: the decode worker's Unix socket against gRPC, side by side.

    python benchmarks/local_hop_ab.py [--models tiny] [--requests 200]

Two `tandem up` clusters run at once on the same model, one with its defaults (Generate over the
decode worker's Unix socket, services/runtime/local_stream.py) and one with `--no-local-sockets`
(every hop on gRPC). One client sends the same distinct 128-token prompts to both, alternating
request by request (64 tokens each, streamed), so drift on a shared machine falls on both alike.
Reported: TTFT p50 and per-token gap p50 of each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from benchmarks.serving_overhead import prompts_for  # noqa: E402
from services.launcher.cluster import AUTO_THREADS, start_cluster  # noqa: E402

OUTPUT_LEN = 64
WAYS = {"socket": (), "gRPC": ("--no-local-sockets",)}


def one_request(http, url: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, median gap between token events) in seconds, one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start = time.perf_counter()
    arrivals = []
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - start, statistics.median(gaps) if gaps else 0.0


def measure(path: Path, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    """way -> (TTFT p50 ms, gap p50 ms); the first request of each warms up."""
    import httpx

    with ExitStack() as stack:
        urls = {way: stack.enter_context(start_cluster(str(path), mode="aggregated", torch_threads=AUTO_THREADS,
                                                       http_port=0, grpc_port=0, extra_args=extra,
                                                       startup_timeout_s=600)).http_url
                for way, extra in WAYS.items()}  # fmt: skip
        http = stack.enter_context(httpx.Client(timeout=600))
        times: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
        for i, prompt in enumerate(prompts):
            order = list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                times[way].append(one_request(http, urls[way], path.name, prompt))
    return {way: (statistics.median(t[0] for t in ts[1:]) * 1e3, statistics.median(t[1] for t in ts[1:]) * 1e3)
            for way, ts in times.items()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny"])
    ap.add_argument("--requests", type=int, default=200, help="requests to each cluster (the first warms up)")
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models:
        path = bench_model(name)
        got = measure(path, prompts_for(path, args.requests, seed=9))
        (sock_ttft, sock_gap), (grpc_ttft, grpc_gap) = got["socket"], got["gRPC"]
        r = dict(model=model_label(name), socket_ttft_ms=sock_ttft, grpc_ttft_ms=grpc_ttft, socket_gap_ms=sock_gap,
                 grpc_gap_ms=grpc_gap, ttft_ratio=sock_ttft / grpc_ttft)  # fmt: skip
        results.append(r)
        print(r, flush=True)
        rows.append([r["model"], sock_ttft, grpc_ttft, r["ttft_ratio"], sock_gap, grpc_gap])
    table = print_table(
        f"The gateway -> decode hop on one box, one stream, alternating requests ({args.requests} each; "
        f"128-token prompts, {OUTPUT_LEN} tokens; p50 ms)",
        ["model", "TTFT, socket", "TTFT, gRPC", "socket / gRPC", "token gap, socket", "token gap, gRPC"], rows)
    write_result("local_hop_ab", {"results": results, "table": table})


if __name__ == "__main__":
    main()
