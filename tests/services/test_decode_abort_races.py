"""Decode's KV when a request's owner leaves at an awkward moment (issue 11, defect 1).

Each test forces one exact interleaving with an explicit hook (the engine thread held on an
event, a cancelled call, an Abort sent while a Reserve is inside the engine), never a random
burst, and asserts the pool is back to its baseline with `check_integrity()` clean. The lease is
600 s, so a test that passes does so because the blocks were freed by the rule under test, not by
a lease running out. Waits are polls with a generous bound: no assertion needs a deadline met.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import pytest

from tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2
from tests.engine.engine_helpers import random_prompts
from tests.services.decode_helpers import (
    DecodeHarness, StandInPrefill, collect, decode_request, decode_settings, poll_until, push,
)  # fmt: skip

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]
LONG_LEASE_S = 600.0
POLL_S = 30.0


@pytest.fixture(scope="module")
def harness(tiny_model):
    h = DecodeHarness(decode_settings(tiny_model, lease_s=LONG_LEASE_S))
    yield h
    h.close()


@pytest.fixture(scope="module")
def prefill(tiny_model):
    return StandInPrefill(tiny_model)


@pytest.fixture(scope="module")
def prompt(harness):
    return random_prompts([45], harness.handle.engine.model_config.vocab_size, seed=21)[0]


@pytest.fixture(autouse=True)
def back_to_baseline(harness):
    yield
    assert harness.baseline_reached(timeout=POLL_S), "a test left blocks, requests or reservations behind"



@contextlib.asynccontextmanager
async def engine_held(harness):
    """Holds the engine thread inside a command until the block exits: commands submitted
    meanwhile queue up behind it, in order, exactly as under a long engine step."""
    release, entered = threading.Event(), threading.Event()

    def hold(engine) -> None:
        entered.set()
        release.wait(POLL_S * 4)

    held = asyncio.ensure_future(harness.handle.loop.call(hold))
    await poll_until(entered.is_set, "the engine thread is held")
    try:
        yield
    finally:
        release.set()
        await held


def reserve_request(rid: str, prompt: list[int]) -> decode_pb2.ReserveRequest:
    return decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt)


def test_reserve_cancelled_while_inside_the_engine_frees_its_blocks(harness, prompt):
    """The caller gives up while the engine is making the reservation: the handler is cancelled
    before the table ever records it, so only the handler can free the engine's blocks."""
    table = harness.handle.table

    async def go():
        async with engine_held(harness):
            call = harness.decode.Reserve(reserve_request("cancel-in-engine", prompt))
            await poll_until(lambda: "cancel-in-engine" in table.reserving, "the Reserve reached the engine")
            call.cancel()
            await poll_until(lambda: "cancel-in-engine" not in table.reserving, "the Reserve handler was cancelled")
        with pytest.raises(asyncio.CancelledError):
            await call

    harness.run(go)


def test_abort_that_overtakes_its_reserve_leaves_nothing_held(harness, prompt):
    """Abort arrives while the Reserve is inside the engine: it finds nothing to free yet; the
    Reserve must notice and free its blocks instead of recording a reservation nobody owns."""
    table = harness.handle.table

    async def go():
        async with engine_held(harness):
            reserve = asyncio.ensure_future(harness.decode.Reserve(reserve_request("overtaken", prompt)))
            await poll_until(lambda: "overtaken" in table.reserving, "the Reserve reached the engine")
            abort = asyncio.ensure_future(harness.decode.Abort(common_pb2.AbortRequest(request_id="overtaken")))
            await poll_until(lambda: "overtaken" in table.aborted, "the Abort was handled up to the engine")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await reserve
        await abort
        assert info.value.code() == grpc.StatusCode.CANCELLED and "aborted" in info.value.details()
        assert "overtaken" not in table.pending

    harness.run(go)


@pytest.mark.parametrize("case", ["bad_sampling", "too_long_for_the_cache"])
def test_generate_refused_before_attaching_frees_the_reservation(harness, prompt, case):
    """A Generate(REMOTE) that is refused (bad params) is the reservation's only user: its blocks
    go at once, not when the lease ends."""

    async def go():
        rid = f"refused-{case}"
        r = await harness.decode.Reserve(reserve_request(rid, prompt))
        assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
        request = decode_request(rid, prompt, 4, remote=True)
        if case == "bad_sampling":
            request.sampling.temperature = -1.0  # refused by the proto edge
        else:
            request.sampling.max_tokens = 64 * 16  # fits the context check of Reserve, not the cache
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(harness.decode.Generate(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await poll_until(lambda: rid not in harness.handle.table.pending, "the reservation was freed")

    harness.run(go)


def test_generate_cancelled_before_attaching_frees_the_reservation(harness, prompt):
    """The gateway's Generate stream is cancelled while decode checks its params (before it
    attaches to the reservation)."""
    table = harness.handle.table

    async def go():
        r = await harness.decode.Reserve(reserve_request("gen-cancel", prompt))
        assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
        async with engine_held(harness):
            # The runner clears the id's abort mark first thing, then submits its check to the
            # engine in the same loop step: a planted mark going away says the check is queued.
            table.aborted["gen-cancel"] = None
            call = harness.decode.Generate(decode_request("gen-cancel", prompt, 4, remote=True))
            waiting = asyncio.ensure_future(collect(call))
            await poll_until(lambda: "gen-cancel" not in table.aborted, "Generate's check reached the engine")
            call.cancel()
            await poll_until(lambda: "gen-cancel" not in table.pending, "the cancelled Generate freed its reservation")
        with pytest.raises(asyncio.CancelledError):
            await waiting

    harness.run(go)


def test_first_token_outside_the_vocabulary_is_refused_and_the_engine_keeps_serving(harness, prefill, prompt):
    """Defect 5: a last piece with first_tokens id 999999 used to crash the engine step of every
    request on the worker. It is refused naming the field; the others run on."""
    vocab = harness.handle.engine.model_config.vocab_size

    async def go():
        bystander = asyncio.ensure_future(collect(harness.decode.Generate(decode_request("bystander", prompt, 24, remote=False))))
        r = await harness.decode.Reserve(reserve_request("bad-first", prompt))
        pieces = prefill.chunks("bad-first", prompt, r)
        pieces[-1].first_tokens[0].token_id = 999999
        call = harness.decode.Generate(decode_request("bad-first", prompt, 4, remote=True, fail=True))
        answer = await push(harness.kv, pieces)
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(call)
        return answer, await bystander

    answer, bystander = harness.run(go)
    assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_INVALID
    assert "first_tokens[0].token_id" in answer.reason and f"[0, {vocab})" in answer.reason
    assert len(bystander.tokens[0]) == 24, "the other request was hurt by the bad piece"


def test_piece_repeating_a_block_is_refused(harness, prefill):
    prompt = random_prompts([70], harness.handle.engine.model_config.vocab_size, seed=22)[0]  # no prefix hit

    async def go():
        r = await harness.decode.Reserve(reserve_request("dup-block", prompt))
        pieces = prefill.chunks("dup-block", prompt, r, max_payload_bytes=1 << 20)
        first = next(p for p in pieces if len(p.block_ids) >= 2)
        first.block_ids[1] = first.block_ids[0]
        return await push(harness.kv, pieces)

    answer = harness.run(go)
    assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_INVALID and "repeat" in answer.reason


def test_engine_reservation_without_an_owner_is_swept(harness, prompt):
    """Backstop: a reservation the engine holds but no handler or table entry owns (a path not
    foreseen) is freed by the lease manager's sweep, not kept forever."""
    from services.decode.remote_kv import RESERVE_PARAMS

    assert harness.engine_call(lambda e: e.reserve_remote("orphan", prompt, RESERVE_PARAMS)) is not None
    assert harness.baseline_reached(timeout=POLL_S)


def test_drain_is_not_held_by_an_unclaimed_reservation(tiny_model, prompt):
    """SIGTERM on a worker holding a reservation whose owner vanished: drain frees it within a
    short grace instead of waiting for a 600 s lease (or its own grace period)."""
    h = DecodeHarness(decode_settings(tiny_model, lease_s=LONG_LEASE_S))
    try:
        async def go():
            r = await h.decode.Reserve(reserve_request("unclaimed", prompt))
            assert r.status == decode_pb2.RESERVE_STATUS_RESERVED
            drain = asyncio.ensure_future(h.handle.drain(grace_s=LONG_LEASE_S))
            await poll_until(drain.done, "drain finished", timeout=POLL_S)
            await drain

        h.run(go, timeout=POLL_S * 2)
        assert not h.handle.table.pending
    finally:
        h.close()


async def _open_push(harness):
    """A PushKV stream fed piece by piece: (call, queue); put None to end it."""
    q: asyncio.Queue = asyncio.Queue()

    async def pieces():
        while (piece := await q.get()) is not None:
            yield piece

    return harness.kv.PushKV(pieces()), q


def test_push_broken_mid_transfer_frees_an_unclaimed_reservation_at_once(harness, prefill):
    """The KV stream breaks in transport after one piece, no Generate attached yet."""
    prompt = random_prompts([70], harness.handle.engine.model_config.vocab_size, seed=23)[0]
    table = harness.handle.table

    async def go():
        r = await harness.decode.Reserve(reserve_request("broken-push", prompt))
        pieces = prefill.chunks("broken-push", prompt, r)
        call, q = await _open_push(harness)
        q.put_nowait(pieces[0])
        await poll_until(lambda: table.pending["broken-push"].next_chunk_index == 1, "the first piece landed")
        call.cancel()
        await poll_until(lambda: "broken-push" not in table.pending, "the reservation was freed")
        assert "broken-push" in table.failures  # a Generate that comes later recomputes

    harness.run(go)
    table.failures.pop("broken-push", None)


def test_push_broken_then_abort_leaves_no_recompute_running(harness, prefill):
    """A Generate is attached: the broken stream starts its local recompute (the default policy);
    the gateway's Abort that follows must end that too."""
    prompt = random_prompts([70], harness.handle.engine.model_config.vocab_size, seed=24)[0]
    table = harness.handle.table

    async def go():
        r = await harness.decode.Reserve(reserve_request("broken-then-abort", prompt))
        pieces = prefill.chunks("broken-then-abort", prompt, r)
        generate = harness.decode.Generate(decode_request("broken-then-abort", prompt, 400, remote=True))
        stream = asyncio.ensure_future(collect(generate))
        await poll_until(lambda: table.pending["broken-then-abort"].attached, "the Generate attached")
        call, q = await _open_push(harness)
        q.put_nowait(pieces[0])
        await poll_until(lambda: table.pending["broken-then-abort"].next_chunk_index == 1, "the first piece landed")
        call.cancel()
        await poll_until(lambda: harness.handle.engine.is_unfinished("broken-then-abort")
                         and "broken-then-abort" not in table.pending, "the local recompute started")
        await harness.decode.Abort(common_pb2.AbortRequest(request_id="broken-then-abort"))
        result = await stream
        assert len(result.tokens.get(0, [])) < 400  # cut short by the Abort, not run to the end

    harness.run(go)


def test_stray_piece_after_the_last_one_does_not_undo_the_transfer(harness, prefill):
    prompt = random_prompts([50], harness.handle.engine.model_config.vocab_size, seed=25)[0]

    async def go():
        r = await harness.decode.Reserve(reserve_request("stray", prompt))
        pieces = prefill.chunks("stray", prompt, r)
        extra = kv_transfer_pb2.KVChunk()
        extra.CopyFrom(pieces[0])
        extra.chunk_index = len(pieces)
        answer = await push(harness.kv, [*pieces, extra])
        result = await collect(harness.decode.Generate(decode_request("stray", prompt, 3, remote=True, fail=True)))
        return answer, result

    answer, result = harness.run(go)
    assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_INVALID and "after the is_last" in answer.reason
    assert result.kv_source_used == decode_pb2.KV_SOURCE_REMOTE and len(result.tokens[0]) == 3


def test_hold_closes_once_generate_claims_and_the_request_runs(harness, prefill, prompt):
    """ReserveAndHold's normal life: one answer, open until the Generate claims the reservation,
    then closed with OK by decode; its end frees nothing the Generate owns."""
    table = harness.handle.table

    async def go():
        hold = harness.decode.ReserveAndHold(reserve_request("held", prompt))
        r = await hold.read()
        assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
        await asyncio.sleep(0.2)
        assert not hold.done(), "the hold closed before anyone claimed the reservation"
        call = harness.decode.Generate(decode_request("held", prompt, 6, remote=True, fail=True))
        stream = asyncio.ensure_future(collect(call))
        await poll_until(lambda: table.pending.get("held") is None or table.pending["held"].attached,
                         "the Generate claimed the reservation")
        assert await hold.code() == grpc.StatusCode.OK
        answer = await push(harness.kv, prefill.chunks("held", prompt, r))
        return answer, await stream

    answer, result = harness.run(go)
    assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_ACCEPTED, answer.reason
    assert len(result.tokens[0]) == 6


@pytest.mark.parametrize("when", ["answered", "pushing"])
def test_cancelled_hold_frees_an_unclaimed_reservation(harness, prefill, prompt, when):
    """The holder lets go (or dies) before any Generate claimed the reservation: freed at once,
    also with KV already landing (the prefill's stream then finds no reservation)."""
    table = harness.handle.table
    rid = f"let-go-{when}"

    async def go():
        hold = harness.decode.ReserveAndHold(reserve_request(rid, prompt))
        r = await hold.read()
        assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
        pushing, q = None, None
        if when == "pushing":
            pushing, q = await _open_push(harness)
            q.put_nowait(prefill.chunks(rid, prompt, r)[0])
            await poll_until(lambda: table.pending[rid].next_chunk_index == 1, "the first piece landed")
        hold.cancel()
        await poll_until(lambda: rid not in table.pending, "the cancelled hold freed the reservation")
        if pushing is not None:
            q.put_nowait(None)
            return await pushing

    answer = harness.run(go)
    if when == "pushing":
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_INCOMPLETE, answer.reason  # and nothing to free
