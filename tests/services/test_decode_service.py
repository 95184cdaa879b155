"""Decode service over a real in-process gRPC server with the tiny model: local and remote KV
generation against transformers, the handshake, bad input, aborts and cancels at every stage."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.kv_transfer.compat import KVLayout
from services.runtime.engine_loop import wait_until
from services.runtime.kv_wire import layout_to_proto
from tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2
from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.decode_helpers import (
    BLOCK_SIZE, DEFAULT_KV_BLOCKS, DecodeHarness, StandInPrefill, collect, decode_request, decode_settings, push,
)  # fmt: skip

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]
Reserved = decode_pb2.RESERVE_STATUS_RESERVED


@pytest.fixture(scope="module")
def harness(tiny_model):
    h = DecodeHarness(decode_settings(tiny_model))
    yield h
    h.close()


@pytest.fixture(scope="module")
def prefill(tiny_model):
    return StandInPrefill(tiny_model)


@pytest.fixture(scope="module")
def prompts(harness):
    vocab = harness.handle.engine.model_config.vocab_size
    return random_prompts([5, 21, 40], vocab, seed=7)


@pytest.fixture(autouse=True)
def back_to_baseline(harness):
    yield
    assert harness.baseline_reached(), "a test left blocks or requests behind"


def test_local_generate_matches_transformers(harness, tiny_model, prompts):
    async def go():
        calls = [collect(harness.decode.Generate(decode_request(f"loc{i}", p, 6, remote=False)))
                 for i, p in enumerate(prompts)]  # fmt: skip
        return await asyncio.gather(*calls)

    results = harness.run(go)
    assert [r.tokens[0] for r in results] == hf_greedy(tiny_model, prompts, 6)
    first, last = results[0], results[0].messages[-1]
    assert first.kv_source_used == decode_pb2.KV_SOURCE_LOCAL
    assert last.usage.prompt_tokens == len(prompts[0]) and last.usage.completion_tokens == 6
    finished = [c for m in first.messages for c in m.choices if c.finish_reason]
    assert [c.finish_reason for c in finished] == [common_pb2.FINISH_REASON_LENGTH]


def test_local_n2_gives_two_choices(harness, prompts):
    result = harness.run(lambda: collect(harness.decode.Generate(decode_request("n2", prompts[1], 4, remote=False, n=2))))
    assert sorted(result.tokens) == [0, 1] and result.tokens[0] == result.tokens[1]  # greedy: alike
    assert result.usage.completion_tokens == 8


def test_remote_flow_matches_local_and_transformers(harness, prefill, tiny_model, prompts):
    async def go(rid, prompt):
        reserve = await harness.decode.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt))
        assert reserve.status == Reserved, reserve.message
        assert len(reserve.dest_block_ids) == -(-(len(prompt) - reserve.num_cached_tokens) // 16)
        stream = harness.decode.Generate(decode_request(rid, prompt, 6, remote=True))
        collecting = asyncio.ensure_future(collect(stream))  # Generate opened before the KV arrives
        await asyncio.sleep(0.05)
        answer = await push(harness.kv, prefill.chunks(rid, prompt, reserve))
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_ACCEPTED, answer.reason
        assert answer.num_chunks_received > 1  # small pieces: several per prompt
        return await collecting

    results = [harness.run(lambda p=p, i=i: go(f"rem{i}", p)) for i, p in enumerate(prompts)]
    assert [r.tokens[0] for r in results] == hf_greedy(tiny_model, prompts, 6)
    assert all(r.kv_source_used == decode_pb2.KV_SOURCE_REMOTE for r in results)
    # The prompts ran locally in the first test: decode's prefix cache covers their full blocks.
    assert results[2].usage.cached_tokens == 32


def test_remote_kv_before_generate(harness, prefill, tiny_model, prompts):
    """KV fully pushed first, Generate opened afterwards: the request starts when both are there."""
    prompt = prompts[2][:37]

    async def go():
        reserve = await harness.decode.Reserve(decode_pb2.ReserveRequest(request_id="late", prompt_token_ids=prompt))
        answer = await push(harness.kv, prefill.chunks("late", prompt, reserve))
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_ACCEPTED, answer.reason
        return await collect(harness.decode.Generate(decode_request("late", prompt, 5, remote=True)))

    assert harness.run(go).tokens[0] == hf_greedy(tiny_model, [prompt], 5)[0]


def test_handshake_names_each_mismatched_field(harness, prefill):
    ok = harness.run(lambda: harness.kv.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(prefill.layout))))
    assert ok.compatible and 0 < ok.max_payload_bytes < 4 << 20
    other = KVLayout(**{**_fields(prefill.layout), "block_size": 32, "dtype": "float16"})
    bad = harness.run(lambda: harness.kv.Handshake(kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(other))))
    assert not bad.compatible
    assert "block_size: local 16 != remote 32" in bad.reason and "dtype" in bad.reason


def _fields(layout: KVLayout) -> dict:
    return {name: getattr(layout, name) for name in layout.__slots__}


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        (dict(rid="", prompt=[5, 6]), "request_id"),
        (dict(rid="b1", prompt=[]), "prompt_token_ids"),
        (dict(rid="b2", prompt=[5, 6], temperature=-1.0), "temperature"),
        (dict(rid="b3", prompt=[5, 6], top_p=0.0), "top_p"),
        (dict(rid="b4", prompt=[10**6]), "prompt_token_ids"),
        (dict(rid="b5", prompt=[5, 6], n=2, remote=True), "sampling.n"),
        (dict(rid="b6", prompt=[5, 6], max_tokens=10**6), "max_tokens"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(harness, request_kwargs, field):
    kwargs = dict(request_kwargs)
    rid, prompt = kwargs.pop("rid"), kwargs.pop("prompt")
    remote = kwargs.pop("remote", False)
    max_tokens = kwargs.pop("max_tokens", 4)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        harness.run(lambda: collect(harness.decode.Generate(decode_request(rid, prompt, max_tokens, remote=remote, **kwargs))))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


def test_kv_source_unspecified_and_unknown_reservation(harness):
    msg = decode_request("u1", [5, 6], 3, remote=False)
    msg.kv_source = decode_pb2.KV_SOURCE_UNSPECIFIED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        harness.run(lambda: collect(harness.decode.Generate(msg)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_source" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        harness.run(lambda: collect(harness.decode.Generate(decode_request("nobody", [5, 6], 3, remote=True))))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_reserve_answers(harness, prefill):
    run, decode = harness.run, harness.decode
    too_long = run(lambda: decode.Reserve(decode_pb2.ReserveRequest(request_id="tl", prompt_token_ids=[7] * 5000)))
    assert too_long.status == decode_pb2.RESERVE_STATUS_TOO_LONG
    wrong = run(lambda: decode.Reserve(decode_pb2.ReserveRequest(request_id="ic", prompt_token_ids=[7, 8],
                                                                   compatibility_hash="deadbeef")))  # fmt: skip
    assert wrong.status == decode_pb2.RESERVE_STATUS_INCOMPATIBLE
    right = run(lambda: decode.Reserve(decode_pb2.ReserveRequest(
        request_id="ok", prompt_token_ids=[7] * 20, compatibility_hash=prefill.layout.compatibility_hash())))  # fmt: skip
    assert right.status == Reserved and right.block_size == 16 and right.kv_transfer_address == harness.handle.address
    assert right.compatibility_hash == prefill.layout.compatibility_hash()
    full = run(lambda: decode.Reserve(decode_pb2.ReserveRequest(request_id="nc", prompt_token_ids=[7] * 1020)))
    assert full.status == decode_pb2.RESERVE_STATUS_NO_CAPACITY, full.message  # 64 blocks needed, 62 free
    with pytest.raises(grpc.aio.AioRpcError) as info:  # same id twice
        run(lambda: decode.Reserve(decode_pb2.ReserveRequest(request_id="ok", prompt_token_ids=[7] * 20)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in info.value.details()
    load = run(lambda: decode.GetLoad(common_pb2.GetLoadRequest()))
    assert load.num_waiting_for_kv == 1 and load.num_reserved_blocks == 2 and load.num_total_blocks == 64
    assert run(lambda: decode.Abort(common_pb2.AbortRequest(request_id="ok"))).aborted  # reservation dropped
    assert not run(lambda: decode.Abort(common_pb2.AbortRequest(request_id="ok"))).aborted  # idempotent


def test_abort_and_cancel_at_every_stage(harness, prefill, prompts):
    prompt = prompts[2][::-1]  # not in decode's prefix cache: every block is shipped

    async def reserve(rid):
        r = await harness.decode.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt))
        assert r.status == Reserved
        return r

    async def cancel_while_waiting_for_kv():
        await reserve("c1")
        call = harness.decode.Generate(decode_request("c1", prompt, 50, remote=True))
        await asyncio.sleep(0.1)
        call.cancel()

    async def abort_mid_transfer():
        r = await reserve("c2")
        pieces = prefill.chunks("c2", prompt, r)
        call = harness.decode.Generate(decode_request("c2", prompt, 50, remote=True))
        assert len(pieces) > 2
        answer = await push(harness.kv, pieces[:-1])  # stream ends early: INCOMPLETE
        assert answer.status == kv_transfer_pb2.PUSH_KV_STATUS_INCOMPLETE
        await harness.decode.Abort(common_pb2.AbortRequest(request_id="c2"))
        result = await collect(call)  # recompute may have started; the abort ends it either way
        assert result.messages[-1].choices[0].finish_reason in (common_pb2.FINISH_REASON_ABORT,)

    async def cancel_mid_decode():
        r = await reserve("c3")
        call = harness.decode.Generate(decode_request("c3", prompt, 200, remote=True))
        await push(harness.kv, prefill.chunks("c3", prompt, r))
        async for msg in call:
            if msg.choices and msg.choices[0].output_index >= 2:
                break
        call.cancel()

    async def abort_local_mid_prefill():
        # As many tokens as the KV cache holds (less a block): the abort must land while c4 runs, however
        # slowly this loop is scheduled on a loaded machine (with 50 the request could finish before the
        # Abort was read, and `aborted` was rightly False; 600 left less room as the kernels got faster)
        long_prompt = prompts[2] * 3
        most = (DEFAULT_KV_BLOCKS - 1) * BLOCK_SIZE - len(long_prompt)
        call = harness.decode.Generate(decode_request("c4", long_prompt, most, remote=False))
        while (await harness.decode.GetLoad(common_pb2.GetLoadRequest())).num_running == 0:
            await asyncio.sleep(0.005)
        assert (await harness.decode.Abort(common_pb2.AbortRequest(request_id="c4"))).aborted
        result = await collect(call)
        assert result.messages[-1].choices[0].finish_reason == common_pb2.FINISH_REASON_ABORT

    for stage in (cancel_while_waiting_for_kv, abort_mid_transfer, cancel_mid_decode, abort_local_mid_prefill):
        harness.run(stage)
        assert harness.baseline_reached(), f"blocks leaked after {stage.__name__}"


def test_the_worker_learns_which_tokens_show_text(harness):
    # Its streaming interval batches tokens, so it loads the model's tokenizer (off its startup
    # path) to hand a request's tokens over one step at a time until its first text has gone out
    # (services/runtime/engine_loop.py; the rule itself: tests/runtime/test_engine_loop.py).
    loop = harness.handle.loop
    assert loop.stream_interval_s > 0
    # Loading a tokenizer takes well under a second; a loaded machine may take longer.
    assert wait_until(lambda: loop.text_tokens is not None, timeout=60, interval=0.05)
    special = harness.handle.engine.eos_token_ids[0]
    assert not loop.text_tokens(special)
