"""A real gRPC server on 127.0.0.1 receives a PushKV stream of a few MiB and rebuilds the KV exactly."""

from __future__ import annotations

import dataclasses
from concurrent import futures

import grpc
import pytest
import torch

from common.kv_transfer import KVChecksumError, KVChunkError, KVLayout, encode_kv_chunks, write_chunk
from services.runtime.kv_wire import chunk_from_proto, chunk_to_proto, handshake_response, layout_to_proto
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

LAYOUT = KVLayout("tandem-test", "LlamaForCausalLM", "bfloat16", block_size=16, num_layers=8, num_kv_heads=4, head_dim=64)
NUM_CACHE_BLOCKS = 128
Status = kv_transfer_pb2.PushKVStatus


class TinyKVTransfer(kv_transfer_pb2_grpc.KVTransferServicer):
    """Just enough of decode's receiver: verify and write every piece into one storage tensor."""

    def __init__(self) -> None:
        # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.storage = torch.zeros(
            (LAYOUT.num_layers, 2, NUM_CACHE_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim),
            dtype=torch.bfloat16,
        )

    def Handshake(self, request, context):
        return handshake_response(LAYOUT, request, max_payload_bytes=1 << 20)

    def PushKV(self, request_iterator, context):
        response = kv_transfer_pb2.PushKVResponse(status=Status.PUSH_KV_STATUS_INCOMPLETE)
        for msg in request_iterator:
            response.request_id = msg.request_id
            chunk = chunk_from_proto(msg)
            if chunk.chunk_index != response.num_chunks_received:
                return self._reject(response, Status.PUSH_KV_STATUS_INVALID, chunk, "chunk_index gap")
            try:
                write_chunk(self.storage, chunk)
            except KVChecksumError as e:
                return self._reject(response, Status.PUSH_KV_STATUS_CHECKSUM_MISMATCH, chunk, str(e))
            except KVChunkError as e:
                return self._reject(response, Status.PUSH_KV_STATUS_INVALID, chunk, str(e))
            response.num_chunks_received += 1
            response.bytes_received += len(chunk.payload)
            if chunk.is_last:
                response.status = Status.PUSH_KV_STATUS_ACCEPTED
        return response

    @staticmethod
    def _reject(response, status, chunk, reason):
        response.status = status
        response.reason = reason
        response.rejected_chunk_index = chunk.chunk_index
        return response


@pytest.fixture
def kv_server():
    servicer = TinyKVTransfer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")  # 0: the OS picks a free port
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, kv_transfer_pb2_grpc.KVTransferStub(channel)
    finally:
        channel.close()
        server.stop(grace=None)


def make_kv(num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    shape = (LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def test_push_kv_stream_reassembles_exactly(kv_server):
    servicer, stub = kv_server
    hello = stub.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(LAYOUT), sender_id="test"))
    assert hello.compatible, hello.reason
    # Two prompt chunks of 48 blocks each: 2 x 6 MiB of bf16, sent as one stream of <= 1 MiB pieces.
    kv = make_kv(96)
    block_ids = list(range(127, 127 - 96, -1))  # scattered destination order
    h = LAYOUT.compatibility_hash()

    def pieces():
        first = list(encode_kv_chunks(kv[:, :, :48], block_ids[:48], request_id="req-1", is_final=False,
                                      max_payload_bytes=hello.max_payload_bytes))  # fmt: skip
        for c in first:
            yield chunk_to_proto(c, compatibility_hash=h)
        for c in encode_kv_chunks(kv[:, :, 48:], block_ids[48:], request_id="req-1",
                                  first_chunk_index=len(first), max_payload_bytes=hello.max_payload_bytes):  # fmt: skip
            yield chunk_to_proto(c, compatibility_hash=h)

    result = stub.PushKV(pieces(), timeout=60)
    assert result.status == Status.PUSH_KV_STATUS_ACCEPTED, result.reason
    assert result.request_id == "req-1"
    assert result.bytes_received == kv.numel() * kv.element_size() == 12 * 1024 * 1024
    assert torch.equal(servicer.storage[:, :, block_ids], kv)


def test_corrupt_piece_is_rejected_over_grpc(kv_server):
    servicer, stub = kv_server
    kv = make_kv(8)
    chunks = list(encode_kv_chunks(kv, range(8), request_id="req-2", max_payload_bytes=128 << 10))
    bad = bytearray(chunks[2].payload)
    bad[0] ^= 0x80
    chunks[2] = dataclasses.replace(chunks[2], payload=bytes(bad))
    result = stub.PushKV(iter(chunk_to_proto(c) for c in chunks), timeout=30)
    assert result.status == Status.PUSH_KV_STATUS_CHECKSUM_MISMATCH
    assert result.rejected_chunk_index == 2 and result.num_chunks_received == 2
    assert "chunk 2 of request 'req-2': checksum mismatch" in result.reason
    written = servicer.storage[chunks[2].layer_start : chunks[2].layer_end, :, list(chunks[2].block_ids)]
    assert not written.any()  # the corrupt piece never reached the cache


def test_incompatible_handshake_names_the_field(kv_server):
    _, stub = kv_server
    other = dataclasses.replace(LAYOUT, block_size=32)
    reply = stub.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(other)))
    assert not reply.compatible
    assert "block_size: local 16 != remote 32" in reply.reason


def test_stream_without_last_piece_is_incomplete(kv_server):
    _, stub = kv_server
    chunks = list(encode_kv_chunks(make_kv(2), [0, 1], request_id="req-3", is_final=False))
    result = stub.PushKV(iter(chunk_to_proto(c) for c in chunks), timeout=30)
    assert result.status == Status.PUSH_KV_STATUS_INCOMPLETE
