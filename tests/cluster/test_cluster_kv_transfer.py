"""Acceptance 5: KV transfer failures are clear errors and free what they held.

Against a real decode process, a client playing prefill sends (a) a layout with another block size
at Handshake, (b) a piece whose checksum does not match its payload, (c) a piece whose
compatibility hash is not decode's, (d) a Reserve with a wrong hash: each is rejected with a
reason naming the field, nothing is written, and after Abort the pool is back to its baseline.
Then a real prefill started with another block size than decode: the request either fails with a
message naming block_size or is recomputed on decode (output still exact), and a service says why.
(That prefill metrics count the prompt tokens and bytes shipped is checked in test_cluster_parity.)
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from common.kv_transfer.codec import payload_checksum
from services.launcher.cluster import Cluster
from services.runtime.kv_wire import layout_from_proto, layout_to_proto
from tests.cluster.cluster_helpers import (ENGINE_ARGS, kv_usage, metrics, post, random_prompts, start_secure_cluster,
                                           wait_for, worker_channel)  # fmt: skip
from tests.engine.engine_helpers import hf_greedy
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc


@pytest.fixture
def decode_channel(disagg: Cluster):
    with worker_channel(disagg.service("decode", 0)) as channel:  # mTLS, the client's certificate
        yield channel


def _decode_layout(channel):
    """Decode's own layout, as its Handshake answer reports it."""
    probe = kv_transfer_pb2.HandshakeRequest(layout=common_pb2.KVLayout(model_id="probe"), sender_id="test")
    return layout_from_proto(kv_transfer_pb2_grpc.KVTransferStub(channel).Handshake(probe, timeout=10).layout)


def _reserve(channel, prompt: list[int], compatibility_hash: str = "") -> tuple[decode_pb2.ReserveResponse, str]:
    request = decode_pb2.ReserveRequest(request_id=f"kvtest-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                                        compatibility_hash=compatibility_hash)  # fmt: skip
    reply = decode_pb2_grpc.DecodeStub(channel).Reserve(request, timeout=10)
    return reply, request.request_id


def _piece(layout, request_id: str, block_id: int, *, corrupt: bool = False, hash_: str | None = None):
    shape = [layout.num_layers, 2, 1, layout.block_size, layout.num_kv_heads, layout.head_dim]
    payload = bytes(4 * layout.num_layers * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim)
    checksum = payload_checksum(payload) ^ (1 if corrupt else 0)
    return kv_transfer_pb2.KVChunk(
        request_id=request_id, chunk_index=0, block_ids=[block_id], layer_start=0, layer_end=layout.num_layers,
        dtype=layout.dtype, shape=shape, payload=payload, checksum=checksum, is_last=False,
        compatibility_hash=layout.compatibility_hash() if hash_ is None else hash_,
    )  # fmt: skip


def _abort(channel, request_id: str) -> None:
    decode_pb2_grpc.DecodeStub(channel).Abort(common_pb2.AbortRequest(request_id=request_id), timeout=10)


def test_handshake_names_mismatched_fields(decode_channel) -> None:
    local = _decode_layout(decode_channel)
    stub = kv_transfer_pb2_grpc.KVTransferStub(decode_channel)
    ok = stub.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(local), sender_id="test"), timeout=10)
    assert ok.compatible, ok.reason
    other = dataclasses.replace(local, block_size=local.block_size * 2, dtype="float16")
    bad = stub.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(other), sender_id="test"), timeout=10)
    assert not bad.compatible
    assert "block_size" in bad.reason and "dtype" in bad.reason, bad.reason


def test_checksum_and_compat_mismatch_rejected_and_freed(disagg: Cluster, decode_channel) -> None:
    decode = disagg.service("decode", 0)
    usage_before = kv_usage(disagg)[decode.name]
    failures_before = metrics(str(decode.metrics_url))
    layout = _decode_layout(decode_channel)
    kv = kv_transfer_pb2_grpc.KVTransferStub(decode_channel)
    prompt = random_prompts([40], seed=9)[0]

    # (a) corrupt payload
    reserved, rid = _reserve(decode_channel, prompt)
    assert reserved.status == decode_pb2.RESERVE_STATUS_RESERVED, reserved.message
    reply = kv.PushKV(iter([_piece(layout, rid, reserved.dest_block_ids[0], corrupt=True)]), timeout=10)
    assert reply.status == kv_transfer_pb2.PUSH_KV_STATUS_CHECKSUM_MISMATCH, reply
    assert "checksum" in reply.reason and reply.rejected_chunk_index == 0, reply.reason
    _abort(decode_channel, rid)

    # (b) piece with a foreign compatibility hash
    reserved, rid = _reserve(decode_channel, prompt)
    assert reserved.status == decode_pb2.RESERVE_STATUS_RESERVED, reserved.message
    reply = kv.PushKV(iter([_piece(layout, rid, reserved.dest_block_ids[0], hash_="0123456789abcdef")]), timeout=10)
    assert reply.status == kv_transfer_pb2.PUSH_KV_STATUS_INCOMPATIBLE, reply
    assert reply.reason, reply
    _abort(decode_channel, rid)

    # (c) reservation for a sender with another layout: refused before any block is held
    reserved, rid = _reserve(decode_channel, prompt, compatibility_hash="0123456789abcdef")
    assert reserved.status == decode_pb2.RESERVE_STATUS_INCOMPATIBLE, reserved
    assert reserved.message

    wait_for(lambda: kv_usage(disagg)[decode.name].used <= usage_before.used and kv_usage(disagg)[decode.name].idle,
             what=f"{decode.name} KV back to {usage_before.used} used blocks")  # fmt: skip
    after = metrics(str(decode.metrics_url))
    for reason in ("checksum", "incompatible"):
        key = f'tandem_kv_transfer_failures_total{{reason="{reason}"}}'
        assert after.get(key, 0.0) > failures_before.get(key, 0.0), f"{key} did not grow"


def test_prefill_with_other_block_size_is_a_clear_error(tiny_model, redis_url, dev_certs, tmp_path) -> None:
    prompt = random_prompts([50], seed=10)[0]
    with start_secure_cluster(tiny_model, dev_certs, num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
                              redis_url=redis_url, extra_args=ENGINE_ARGS,
                              service_args={"prefill": ["--block-size", "8"]}, run_dir=str(tmp_path)) as cluster:  # fmt: skip
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        reply = post(cluster, "/v1/completions", json=body, timeout=120)
        if reply.status_code == 200:  # recomputed on decode: must still be exact
            assert reply.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model, [prompt], 6)[0]
        else:
            assert 500 <= reply.status_code < 600 or reply.status_code == 400, reply.text
            assert "block_size" in reply.text, reply.text
        logs = {p.name: p.log_path.read_text(errors="replace") for p in cluster.processes}
        named = [name for name, text in logs.items() if "block_size" in text]
        assert named, "no service said why the KV transfer was refused (no 'block_size' in any log)"
        # The cluster still works for the next request, and nothing is left held.
        again = post(cluster, "/v1/completions", json=body, timeout=120)
        assert again.status_code == reply.status_code
        wait_for(lambda: all(u.idle for u in kv_usage(cluster).values()), what="no request left in flight")
