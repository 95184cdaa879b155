"""Decode service when remote KV goes wrong: corrupt and incompatible pieces, expired leases, the
recompute and fail policies; plus its registry record, metrics and drain."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.registry import Role
from tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2
from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.decode_helpers import (
    DecodeHarness, StandInPrefill, collect, decode_request, decode_settings, push,
)  # fmt: skip

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]
LEASE_S = 0.6


@pytest.fixture(scope="module")
def harness(tiny_model, redis_url):
    h = DecodeHarness(decode_settings(tiny_model, lease_s=LEASE_S, redis_url=redis_url, cluster="decode-kv-failures"))
    yield h
    h.close()


@pytest.fixture(scope="module")
def prefill(tiny_model):
    return StandInPrefill(tiny_model)


@pytest.fixture(scope="module")
def prompt(harness):
    return random_prompts([45], harness.handle.engine.model_config.vocab_size, seed=11)[0]


@pytest.fixture(autouse=True)
def back_to_baseline(harness):
    yield
    assert harness.baseline_reached(), "a test left blocks or requests behind"


def failures(harness, reason: str) -> float:
    return harness.handle.metrics.registry.get_sample_value("tandem_kv_transfer_failures_total", {"reason": reason}) or 0.0


def corrupt(pieces, index: int = 1):
    pieces[index].payload = bytes([pieces[index].payload[0] ^ 0xFF]) + pieces[index].payload[1:]
    return pieces


async def reserve(harness, rid, prompt):
    r = await harness.decode.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt))
    assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
    return r


def test_corrupt_piece_is_rejected_and_recompute_gives_the_right_tokens(harness, prefill, prompt, tiny_model):
    before = failures(harness, "checksum")

    async def go():
        r = await reserve(harness, "bad-rc", prompt)
        call = harness.decode.Generate(decode_request("bad-rc", prompt, 6, remote=True))
        answer = await push(harness.kv, corrupt(prefill.chunks("bad-rc", prompt, r)))
        return answer, await collect(call)

    answer, result = harness.run(go)
    assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_CHECKSUM_MISMATCH
    assert answer.rejected_chunk_index == 1 and "checksum" in answer.reason and answer.num_chunks_received == 1
    assert result.tokens[0] == hf_greedy(tiny_model, [prompt], 6)[0]
    assert result.kv_source_used == decode_pb2.KV_SOURCE_LOCAL  # fell back to local prefill
    assert failures(harness, "checksum") == before + 1
    assert harness.handle.metrics.registry.get_sample_value("tandem_prefill_tokens_total") >= len(prompt) - 32


def test_corrupt_piece_before_generate_then_recompute(harness, prefill, prompt, tiny_model):
    """The transfer fails while no Generate is open: blocks freed at once, the later call recomputes."""
    other = prompt[::-1]

    async def go():
        r = await reserve(harness, "bad-early", other)
        answer = await push(harness.kv, corrupt(prefill.chunks("bad-early", other, r), 0))
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_CHECKSUM_MISMATCH
        assert (await harness.decode.GetLoad(common_pb2.GetLoadRequest())).num_waiting_for_kv == 0
        return await collect(harness.decode.Generate(decode_request("bad-early", other, 4, remote=True)))

    assert harness.run(go).tokens[0] == hf_greedy(tiny_model, [other], 4)[0]


def test_corrupt_piece_under_fail_policy_errors_clearly(harness, prefill, prompt):
    async def go():
        r = await reserve(harness, "bad-fail", prompt)
        call = harness.decode.Generate(decode_request("bad-fail", prompt, 6, remote=True, fail=True))
        await push(harness.kv, corrupt(prefill.chunks("bad-fail", prompt, r)))
        return await collect(call)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        harness.run(go)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV transfer failed" in info.value.details() and "checksum" in info.value.details()


def test_incompatible_and_malformed_pieces_are_rejected(harness, prefill, prompt):
    async def one(rid, mutate):
        r = await reserve(harness, rid, prompt)
        pieces = prefill.chunks(rid, prompt, r)
        mutate(pieces, set(r.dest_block_ids))
        call = harness.decode.Generate(decode_request(rid, prompt, 2, remote=True, fail=True))
        answer = await push(harness.kv, pieces)
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(call)
        return answer

    def wrong_hash(p, _):
        p[0].compatibility_hash = "0" * 16

    def foreign_block(p, reserved):
        p[1].block_ids[0] = min(set(range(64)) - reserved)  # some other request's (or a free) block

    def gap(p, _):
        p[1].chunk_index = 5

    cases = {"hash": (wrong_hash, kv_transfer_pb2.PUSH_KV_STATUS_INCOMPATIBLE, "compatibility_hash"),
             "block": (foreign_block, kv_transfer_pb2.PUSH_KV_STATUS_INVALID, "block_ids"),
             "gap": (gap, kv_transfer_pb2.PUSH_KV_STATUS_INVALID, "chunk_index")}  # fmt: skip
    for name, (mutate, status, field) in cases.items():
        answer = harness.run(lambda: one(f"mal-{name}", mutate))
        assert answer.status == status and field in answer.reason, (name, answer)
    unknown = harness.run(lambda: push(harness.kv, [kv_transfer_pb2.KVChunk(request_id="ghost", is_last=True)]))
    assert unknown.status == kv_transfer_pb2.PUSH_KV_STATUS_UNKNOWN_REQUEST


def test_lease_expiry_frees_the_reservation(harness, prefill, prompt, tiny_model):
    before = failures(harness, "expired")

    async def unclaimed():
        await reserve(harness, "lease-1", prompt)
        assert (await harness.decode.GetLoad(common_pb2.GetLoadRequest())).num_waiting_for_kv == 1
        await asyncio.sleep(LEASE_S * 2)
        return await harness.decode.GetLoad(common_pb2.GetLoadRequest())

    load = harness.run(unclaimed)
    assert load.num_waiting_for_kv == 0 and load.num_reserved_blocks == 0
    assert failures(harness, "expired") == before + 1

    async def waiting_stream(fail: bool):
        rid = f"lease-{fail}"
        await reserve(harness, rid, prompt)
        started = time.monotonic()
        result = await collect(harness.decode.Generate(decode_request(rid, prompt, 3, remote=True, fail=fail)))
        return result, time.monotonic() - started

    result, waited = harness.run(lambda: waiting_stream(False))  # no KV ever comes: recompute
    assert result.tokens[0] == hf_greedy(tiny_model, [prompt], 3)[0] and waited >= LEASE_S * 0.8
    with pytest.raises(grpc.aio.AioRpcError) as info:
        harness.run(lambda: waiting_stream(True))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "lease" in info.value.details()
    # A piece for an expired reservation is refused.
    late = harness.run(lambda: push(harness.kv, prefill.chunks("lease-1", prompt, decode_pb2.ReserveResponse(
        dest_block_ids=[1, 2, 3]))))  # fmt: skip
    assert late.status == kv_transfer_pb2.PUSH_KV_STATUS_UNKNOWN_REQUEST


def test_registry_record_has_load_numbers(harness, registry_for):
    reg = registry_for("decode-kv-failures")
    deadline = time.monotonic() + 5
    while True:
        workers = [w for w in reg.list_workers() if w.role == Role.DECODE]
        if workers or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(workers) == 1
    w = workers[0]
    assert w.address == harness.handle.address and w.model == "tiny-test"
    assert w.kv_blocks_total == 64 and 0 < w.kv_blocks_free <= 64
    assert w.extra.get("prefix_hashes"), "recent prompt prefixes are published for affinity"


def test_metrics_count_received_bytes(harness):
    value = harness.handle.metrics.registry.get_sample_value("tandem_kv_transfer_bytes_total", {"direction": "recv"})
    assert value and value > 0
    assert harness.handle.metrics.registry.get_sample_value("tandem_kv_blocks_total") == 64


def test_drain_refuses_new_work_finishes_in_flight_and_deregisters(tiny_model, redis_url, registry_for, prefill):
    """The in-flight request waits for its KV (held there by the test, not by timing: a loaded
    machine could otherwise finish it, and the drain with it, before the checks run)."""
    h = DecodeHarness(decode_settings(tiny_model, redis_url=redis_url, cluster="decode-drain"))
    reg = registry_for("decode-drain")
    prompt = [9] * 30
    try:
        async def go():
            health = health_pb2_grpc.HealthStub(h.channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            reservation = await reserve(h, "d1", prompt)
            in_flight = asyncio.ensure_future(collect(h.decode.Generate(decode_request("d1", prompt, 40, remote=True))))
            drain = asyncio.ensure_future(h.handle.drain(grace_s=600))
            while (await health.Check(health_pb2.HealthCheckRequest())).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.01)
            refused = await h.decode.Reserve(decode_pb2.ReserveRequest(request_id="d2", prompt_token_ids=[9, 9]))
            assert refused.status == decode_pb2.RESERVE_STATUS_DRAINING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(h.decode.Generate(decode_request("d3", [9, 9], 2, remote=False)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not drain.done()  # d1 still holds the drain open
            answer = await push(h.kv, prefill.chunks("d1", prompt, reservation))  # the KV lands mid-drain
            result = await in_flight
            await drain
            return answer, result

        answer, result = h.run(go, timeout=300)
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_ACCEPTED and result.kv_source_used == decode_pb2.KV_SOURCE_REMOTE
        assert len(result.tokens[0]) == 40  # the in-flight request finished
        assert result.tokens[0] == hf_greedy(tiny_model, [prompt], 40)[0]
        assert not [w for w in reg.list_workers() if w.role == Role.DECODE]
    finally:
        h.close()


@pytest.fixture
def registry_for(redis_url):
    from services.runtime.registry import Registry

    made = []

    def make(cluster: str) -> Registry:
        made.append(Registry(redis_url, cluster))
        return made[-1]

    yield make
    for reg in made:
        reg.close()
