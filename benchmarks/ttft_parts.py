"""Where one stream's time to first token goes: the gateway, the decode worker, the engine.

    python benchmarks/ttft_parts.py [--models tiny] [--requests 30]

For each model, in one run: the engine alone in this process (the prompt's step: prefill and the
first token, serving_overhead.engine_times with `tandem up`'s thread count for decode), then `tandem up`'s defaults, where the
same kind of prompt (distinct 128-token prompts, max_tokens 1) is sent alternately to the gateway
(/v1/completions, streamed, first SSE event) and straight to the decode worker's Generate the way
the gateway calls it (its Unix socket on one box, services/runtime/local_stream.py; gRPC where it
publishes none), first message. The differences are the gateway's share and the decode worker's
share (the hop, servicer, engine-thread hand-offs) of TTFT.

The engine's prompt step is also timed after an idle pause before each prompt (PAUSES_S, taken in
turn so drift falls on each alike): served, a prompt always follows a pause (the client, the
gateway and the hop run before it), and on a shared VM a step after a pause was found slower than
one in a loop of steps (the core's caches cool between bursts), so part of what the hop seems to
cost is the engine's own step at that moment.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from benchmarks.serving_overhead import alone_engine, engine_times, prompts_for  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402
from services.launcher.cluster import AUTO_THREADS, ClusterSpec, start_cluster  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
PAUSES_S = (0.0, 0.005, 0.02)


def prompt_step_after_pause_ms(path: Path, prompts: list[list[int]], threads: int) -> dict[float, float]:
    """pause (s) -> p50 ms of the engine's prompt step (its first token) after sleeping that long,
    the pauses in turn, one fresh prompt each (the engine alone in this process)."""
    engine = alone_engine(path, threads)
    times: dict[float, list[float]] = {pause: [] for pause in PAUSES_S}
    try:
        for i, prompt in enumerate(prompts):
            pause = PAUSES_S[i % len(PAUSES_S)]
            engine.add_request(f"p{i}", prompt_token_ids=prompt, params=FIRST_TOKEN)
            time.sleep(pause)
            start = time.perf_counter()
            engine.step()
            if i >= len(PAUSES_S):  # the first of each warms up
                times[pause].append(time.perf_counter() - start)
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        del engine
        gc.collect()
    return {pause: statistics.median(t) * 1e3 for pause, t in times.items()}


def served_first_token_ms(path: Path, prompts: list[list[int]]) -> tuple[float, float]:
    """(via the gateway, straight to decode) TTFT p50 in ms, the two alternating."""
    import asyncio

    import grpc
    import httpx

    from services.gateway.workers import sampling_to_proto
    from services.runtime.local_stream import LocalConnections, LocalStreamCall
    from services.runtime.registry import Registry, local_socket_of
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    with start_cluster(str(path), mode="aggregated", torch_threads=AUTO_THREADS, http_port=0, grpc_port=0,
                       startup_timeout_s=600) as cluster, httpx.Client(timeout=600) as http:  # fmt: skip
        (worker,) = Registry(cluster.redis_url, cluster.cluster).list_workers("decode")
        local = local_socket_of(worker)
        loop = asyncio.new_event_loop()
        kept = LocalConnections(local) if local is not None else None  # as the gateway keeps them
        with grpc.insecure_channel(worker.address) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)

            async def first_local(request: decode_pb2.DecodeRequest) -> None:
                call = LocalStreamCall(local, "Generate", request, decode_pb2.DecodeResponse, None,
                                       fallback=lambda: None, connections=kept)  # fmt: skip
                it = aiter(call)
                try:
                    await anext(it)
                finally:
                    call.release()  # max_tokens 1: the request is over on decode
                    await it.aclose()

            def via_gateway(prompt: list[int]) -> float:
                body = {"model": path.name, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                start = time.perf_counter()
                with http.stream("POST", cluster.http_url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            return time.perf_counter() - start
                raise RuntimeError("no token came back")

            def via_decode(prompt: list[int], i: int) -> float:
                request = decode_pb2.DecodeRequest(request_id=f"ttft-{i}", prompt_token_ids=prompt,
                                                   sampling=sampling_to_proto(FIRST_TOKEN),
                                                   kv_source=decode_pb2.KV_SOURCE_LOCAL)  # fmt: skip
                start = time.perf_counter()
                if local is not None:
                    loop.run_until_complete(first_local(request))
                    took = time.perf_counter() - start
                    loop.run_until_complete(kept.settle())  # its status read: the connection kept for the next
                    return took
                for _ in stub.Generate(request, timeout=600):
                    return time.perf_counter() - start
                raise RuntimeError("no token came back")

            gateway, decode = [], []
            for i in range(0, len(prompts) - 1, 2):
                gateway.append(via_gateway(prompts[i]))
                decode.append(via_decode(prompts[i + 1], i))
        loop.close()
    return statistics.median(gateway[1:]) * 1e3, statistics.median(decode[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny"])
    ap.add_argument("--requests", type=int, default=30, help="requests each way (the first warms up)")
    args = ap.parse_args()
    rows, results = [], []
    for name in args.models:
        path = bench_model(name)
        prompts = prompts_for(path, 3 * args.requests, seed=5)
        threads = ClusterSpec(model=str(path), mode="aggregated", torch_threads=AUTO_THREADS).threads_per_engine()
        engine_ms, _ = engine_times(path, prompts[: args.requests], threads)  # the prompt's step
        paused = prompt_step_after_pause_ms(path, prompts_for(path, 3 * args.requests, seed=6), threads)
        gateway_ms, decode_ms = served_first_token_ms(path, prompts[args.requests :])
        r = dict(model=model_label(name), threads=threads, engine_ms=engine_ms, decode_direct_ms=decode_ms,
                 gateway_http_ms=gateway_ms, decode_share_ms=decode_ms - engine_ms,
                 gateway_share_ms=gateway_ms - decode_ms,
                 engine_after_pause_ms={f"{p * 1e3:g}": ms for p, ms in paused.items()})  # fmt: skip
        results.append(r)
        print(r, flush=True)
        rows.append([r["model"], threads, engine_ms, *paused.values(), decode_ms, gateway_ms, r["decode_share_ms"],
                     r["gateway_share_ms"]])  # fmt: skip
    table = print_table(
        "Time to first token at one stream, by where it goes: distinct 128-token prompts, max_tokens 1 (p50 ms)",
        ["model", "threads", "engine step", *(f"engine step after {p * 1e3:g} ms idle" for p in PAUSES_S),
         "straight to decode (its hop)", "through the gateway (HTTP)", "decode worker's share",
         "gateway's share"], rows)  # fmt: skip
    write_result("ttft_parts", {"results": results, "table": table})


if __name__ == "__main__":
    main()
