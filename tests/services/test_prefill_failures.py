"""Prefill worker failure paths: incompatible decode, aborts and cancels, bad input, registry, drain."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.prefill.main import serve
from services.runtime.registry import Role
from tests.engine.engine_helpers import greedy, make_engine, random_prompts
from tests.services.prefill_helpers import prefill_chunks, prefill_settings, start_receiver
from tests.services.test_prefill_transfer import slow_steps, wait_idle
from tandem.v1 import common_pb2, kv_transfer_pb2, prefill_pb2_grpc

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


async def expect_error(stub, chunks) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.Prefill(iter(list(chunks))):
            pass
    return info.value


def test_incompatible_decode_layout_fails_naming_the_field(tiny_model):
    prompt = random_prompts([40], vocab=512)[0]

    async def main():
        handle = await serve(prefill_settings(tiny_model), grpc_port=0)
        # decode with 8-token blocks: its KV layout differs from prefill's 16-token blocks
        receiver, server, address = await start_receiver(make_engine(tiny_model, block_size=8, num_blocks=64), "tiny")
        channel = grpc.aio.insecure_channel(handle.address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            reservation = await receiver.reserve("x", prompt, greedy(4))
            reservation.block_ids = reservation.block_ids[:3]  # what 16-token blocks need, so the header is valid
            errors = [
                await expect_error(stub, prefill_chunks("x", prompt, reservation, address, compatibility_hash=h))
                for h in (receiver.layout.compatibility_hash(), "")  # gateway passes decode's hash / none
            ]
            await wait_idle(handle.engine_loop)
            assert receiver.pieces == [], "no KV may move between incompatible layouts"
            return errors
        finally:
            await channel.close()
            await handle.stop()
            await server.stop(None)
            receiver.engine_loop.stop()

    for error in asyncio.run(main()):
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: local 8 != remote 16" in error.details()


def test_abort_and_cancel_mid_prefill_free_every_block(tiny_model):
    prompts = random_prompts([300, 300], vocab=512, seed=5)

    async def main():
        handle = await serve(prefill_settings(tiny_model, budget=16), grpc_port=0)
        slow_steps(handle.engine, 0.02, [])
        receiver, server, address = await start_receiver(make_engine(tiny_model, num_blocks=64), "tiny")
        base_free = receiver.engine.kv.num_free_blocks
        channel = grpc.aio.insecure_channel(handle.address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            outcomes = {}
            for rid, prompt, how in (("ab", prompts[0], "abort"), ("cc", prompts[1], "cancel")):
                reservation = await receiver.reserve(rid, prompt, greedy(4))
                call = stub.Prefill(iter(list(prefill_chunks(rid, prompt, reservation, address))))
                first = await call.read()
                assert 0 < first.num_computed_tokens < len(prompt)
                while first.kv_bytes_sent == 0:  # abort only once KV pieces are on their way
                    first = await call.read()
                    assert first.num_computed_tokens < len(prompt)
                load = await stub.GetLoad(common_pb2.GetLoadRequest())
                assert load.num_running == 1 and 0 < load.num_queued_tokens < len(prompt)
                assert load.num_transfers_in_flight == 1 and load.num_free_blocks < load.num_total_blocks
                if how == "abort":
                    answer = await stub.Abort(common_pb2.AbortRequest(request_id=rid, reason="client left"))
                    assert answer.aborted
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    outcomes[rid] = (info.value.code(), info.value.details())
                else:
                    call.cancel()
                await wait_idle(handle.engine_loop)  # prefill: every block back, nothing running
                assert await receiver.tokens(rid) == []  # decode's stream ends: its reservation was freed
            await wait_idle(receiver.engine_loop)
            assert receiver.engine.kv.num_free_blocks == base_free
            again = await stub.Abort(common_pb2.AbortRequest(request_id="ab"))
            return outcomes, again, dict(receiver.results), handle.table.load()
        finally:
            await channel.close()
            await handle.stop()
            await server.stop(None)
            receiver.engine_loop.stop()

    outcomes, again, results, load = asyncio.run(main())
    assert outcomes["ab"][0] == grpc.StatusCode.CANCELLED and "client left" in outcomes["ab"][1]
    assert not again.aborted, "aborting a finished id is not an error"
    incomplete = kv_transfer_pb2.PushKVStatus.PUSH_KV_STATUS_INCOMPLETE
    assert results["ab"].status == incomplete and results["cc"].status == incomplete
    # (Pieces were on their way: prefill had sent KV bytes. Whether decode had read one yet when
    # the abort came is up to scheduling, so it is not asserted.)
    assert load.num_running == 0 and load.num_queued_tokens == 0


def test_bad_input_is_invalid_argument_naming_the_field(tiny_model):
    prompt = random_prompts([40], vocab=512)[0]

    async def main():
        handle = await serve(prefill_settings(tiny_model), grpc_port=0)
        receiver, server, address = await start_receiver(make_engine(tiny_model, num_blocks=64), "tiny")
        channel = grpc.aio.insecure_channel(handle.address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            reservation = await receiver.reserve("v", prompt, greedy(4))

            def chunks(**kw):
                return list(prefill_chunks("v", prompt, reservation, address, **kw))

            no_header = chunks()
            no_header[0].ClearField("header")
            short = chunks()
            del short[0].header.dest_block_ids[-1]
            odd_skip = chunks()
            odd_skip[0].header.num_skip_tokens = 5
            gap = chunks()
            gap[1].chunk_index = 7
            too_few = chunks()
            too_few[0].header.num_prompt_tokens = 45  # same 3 blocks, 5 tokens never come
            out_of_vocab = chunks()
            out_of_vocab[1].token_ids[0] = 10**6
            cases = {
                "header": no_header,
                "header.dest_block_ids": short,
                "header.num_skip_tokens": odd_skip,
                "chunk_index": gap,
                "token_ids": too_few,
                "sampling.temperature": chunks(sampling={"temperature": -1.0}),
                "sampling.n": chunks(sampling={"n": 2}),
                "prompt_token_ids": out_of_vocab,
            }
            errors = {field: await expect_error(stub, c) for field, c in cases.items()}
            await wait_idle(handle.engine_loop)
            load = await stub.GetLoad(common_pb2.GetLoadRequest())
            return errors, load
        finally:
            await channel.close()
            await handle.stop()
            await server.stop(None)
            receiver.engine_loop.stop()

    errors, load = asyncio.run(main())
    for field, error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error.details())
        assert error.details().startswith(f"{field}:"), (field, error.details())
    assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks


def test_registers_heartbeats_and_deregisters_on_drain(tiny_model, redis_url, cluster, registry):
    async def main():
        handle = await serve(prefill_settings(tiny_model, redis_url=redis_url, cluster=cluster), grpc_port=0)
        try:
            deadline = time.monotonic() + 5
            workers = []
            while not workers and time.monotonic() < deadline:
                workers = await asyncio.to_thread(registry.list_workers, Role.PREFILL)
                await asyncio.sleep(0.05)
            assert len(workers) == 1
            w = workers[0]
            assert (w.address, w.model, w.kv_blocks_total) == (handle.address, "tiny", 128)
            assert w.queued_tokens == 0
        finally:
            await handle.stop()
        assert handle.servicer.draining
        assert await asyncio.to_thread(registry.list_workers, Role.PREFILL) == []

    asyncio.run(main())


def test_main_rejects_bad_settings_with_the_flag_named(tiny_model, capsys):
    from services.prefill.main import main

    assert main(["--model", str(tiny_model), "--block-size", "0"]) == 2
    assert "--block-size=0" in capsys.readouterr().err


def test_prefill_dials_only_registered_decode_workers(tiny_model, redis_url, cluster):
    """Defect 5: prefill used to dial any decode address a caller named. With a registry it pushes
    KV only to registered decode workers, and says so naming the field."""
    prompt = random_prompts([40], vocab=512)[0]

    async def main():
        handle = await serve(prefill_settings(tiny_model, redis_url=redis_url, cluster=cluster), grpc_port=0)
        receiver, server, address = await start_receiver(make_engine(tiny_model, num_blocks=64), "tiny")
        channel = grpc.aio.insecure_channel(handle.address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            reservation = await receiver.reserve("stranger", prompt, greedy(4))
            error = await expect_error(stub, prefill_chunks("stranger", prompt, reservation, address))
            handshakes = len(handle.peers._peers)
            await wait_idle(handle.engine_loop)
            return error, handshakes
        finally:
            await channel.close()
            await server.stop(None)
            await handle.stop()
            receiver.engine_loop.stop()

    error, handshakes = asyncio.run(main())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header.decode_address" in error.details() and "not a decode worker registered" in error.details()
    assert handshakes == 0, "prefill dialed the unregistered address"
