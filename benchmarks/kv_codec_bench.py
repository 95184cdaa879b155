"""KV transfer over a real loopback gRPC stream vs a raw memcpy of the same bytes.

    .venv/bin/python benchmarks/kv_codec_bench.py [--repeats 3] [--out benchmarks/results/kv_codec.json]

A ~64 MiB bf16 KV tensor (16 layers x 63 blocks of 16 tokens x 8 KV heads x 128 dim, Llama-8B-like
heads; 63 blocks so that the "4 MiB-safe" limit gives full 3.94 MiB pieces) is pushed through
KVTransfer.PushKV to a receiver in another process, as prefill would push it to decode:
encode (numpy view -> bytes, xxh3 checksum) -> protobuf -> gRPC -> checksum verify -> write into
the receiver's paged storage. Measured per piece-size limit (256 KiB, 1 MiB, 4 MiB-safe):

  - end_to_end:  first piece encoded -> receiver's response (everything above), MiB/s
  - encode:      codec + protobuf serialization only, on the sender, MiB/s
  - receive:     protobuf parse + checksum verify + write into storage only, MiB/s
  - memcpy:      torch clone of the same tensor, MiB/s (the floor any copy-based path pays)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import grpc  # noqa: E402
import torch  # noqa: E402

from common.kv_transfer import MAX_SAFE_PAYLOAD_BYTES, encode_kv_chunks, write_chunk  # noqa: E402
from services.runtime.kv_wire import chunk_from_proto, chunk_to_proto  # noqa: E402
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc  # noqa: E402

# [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
SHAPE = (16, 2, 63, 16, 8, 128)
DTYPE = torch.bfloat16
PIECE_LIMITS = {"256KiB": 256 << 10, "1MiB": 1 << 20, "4MiB-safe": MAX_SAFE_PAYLOAD_BYTES}
MiB = float(1 << 20)


class _Receiver(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self) -> None:
        self.storage = torch.zeros(SHAPE, dtype=DTYPE)

    def PushKV(self, request_iterator, context):
        received = 0
        for msg in request_iterator:
            chunk = chunk_from_proto(msg)
            write_chunk(self.storage, chunk)  # verifies the checksum first
            received += len(chunk.payload)
        return kv_transfer_pb2.PushKVResponse(status=kv_transfer_pb2.PUSH_KV_STATUS_ACCEPTED, bytes_received=received)


def _serve(port_queue, stop_event) -> None:
    torch.set_num_threads(1)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(_Receiver(), server)
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop_event.wait()
    server.stop(grace=None)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / MiB / seconds


def bench(repeats: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(SHAPE, generator=g).to(DTYPE)
    nbytes = kv.numel() * kv.element_size()
    block_ids = list(range(SHAPE[2]))

    memcpy = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        kv.clone()
        memcpy.append(time.perf_counter() - t0)
    memcpy_rate = _rate(nbytes, min(memcpy))

    ctx = mp.get_context("spawn")
    port_queue, stop_event = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(port_queue, stop_event), daemon=True)
    server.start()
    port = port_queue.get(timeout=60)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    stub = kv_transfer_pb2_grpc.KVTransferStub(channel)

    results = {}
    try:
        # Warm-up (page faults, gRPC connection, allocator) so the first limit is not penalized.
        warm = (chunk_to_proto(c) for c in encode_kv_chunks(kv, block_ids, request_id="warm"))
        stub.PushKV(warm, timeout=300)
        for label, limit in PIECE_LIMITS.items():
            def messages():
                for c in encode_kv_chunks(kv, block_ids, request_id="bench", max_payload_bytes=limit):
                    yield chunk_to_proto(c, compatibility_hash="0123456789abcdef")

            # encode only (sender CPU cost), and the receiver's per-piece work, without the network
            t0 = time.perf_counter()
            wire = [m.SerializeToString() for m in messages()]
            encode_s = time.perf_counter() - t0
            sink = torch.zeros(SHAPE, dtype=DTYPE)
            t0 = time.perf_counter()
            for raw in wire:
                write_chunk(sink, chunk_from_proto(kv_transfer_pb2.KVChunk.FromString(raw)))
            receive_s = time.perf_counter() - t0
            assert torch.equal(sink, kv)
            sizes = [len(raw) for raw in wire]
            del wire, sink

            end_to_end = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                reply = stub.PushKV(messages(), timeout=300)
                end_to_end.append(time.perf_counter() - t0)
                assert reply.bytes_received == nbytes
            best = min(end_to_end)
            results[label] = {
                "max_payload_bytes": limit,
                "num_messages": len(sizes),
                "max_message_bytes": max(sizes),
                "mean_message_bytes": round(statistics.mean(sizes)),
                "end_to_end_mib_s_best": round(_rate(nbytes, best), 1),
                "end_to_end_mib_s_median": round(_rate(nbytes, statistics.median(end_to_end)), 1),
                "end_to_end_seconds": [round(s, 4) for s in end_to_end],
                "encode_mib_s": round(_rate(nbytes, encode_s), 1),
                "receive_mib_s": round(_rate(nbytes, receive_s), 1),
                "fraction_of_memcpy": round(_rate(nbytes, best) / memcpy_rate, 4),
            }
    finally:
        channel.close()
        stop_event.set()
        server.join(timeout=10)

    return {
        "benchmark": "kv_codec",
        "what": "bf16 KV tensor pushed over loopback gRPC (PushKV, separate receiver process) vs torch clone",
        "shape": list(SHAPE),
        "dtype": "bfloat16",
        "tensor_mib": round(nbytes / MiB, 2),
        "repeats": repeats,
        "memcpy_mib_s": round(memcpy_rate, 1),
        "results": results,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "grpc": grpc.__version__,
            "torch": torch.__version__,
            "note": "2 CPU cores shared with other workloads; loopback only",
        },
    }


def print_table(report: dict) -> None:
    print(f"KV tensor {report['shape']} {report['dtype']} = {report['tensor_mib']} MiB; "
          f"memcpy (torch clone): {report['memcpy_mib_s']:.0f} MiB/s")  # fmt: skip
    header = f"{'piece limit':<11} {'msgs':>5} {'max msg':>10} {'e2e best':>10} {'e2e med':>9} {'encode':>8} {'receive':>8} {'vs memcpy':>9}"
    print(header)
    print("-" * len(header))
    for label, r in report["results"].items():
        print(
            f"{label:<11} {r['num_messages']:>5} {r['max_message_bytes'] / MiB:>8.2f}Mi "
            f"{r['end_to_end_mib_s_best']:>8.0f}/s {r['end_to_end_mib_s_median']:>7.0f}/s "
            f"{r['encode_mib_s']:>6.0f}/s {r['receive_mib_s']:>6.0f}/s {r['fraction_of_memcpy']:>8.1%}"
        )
    print("(rates in MiB/s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_codec.json")
    args = parser.parse_args()
    report = bench(args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
