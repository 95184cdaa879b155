"""A request aborted while its KV is in flight between a real prefill and a real decode worker
(issue 11, defect 1): decode's engine thread is held so a pushed piece sits inside decode, mid
write, while the gateway's abort arrives (both streams cancelled, Prefill.Abort and Decode.Abort,
as `Orchestrator._cleanup` does). Both pools must end at their baseline with check_integrity()
clean, the decode one without waiting for its 600 s lease."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from services.decode.server import serve as serve_decode
from services.prefill.main import serve as serve_prefill
from services.runtime.kv_wire import sampling_params_from_dict
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.engine.engine_helpers import random_prompts
from tests.services.decode_helpers import MODEL_ID, decode_request, decode_settings, poll_until
from tests.services.prefill_helpers import prefill_settings
from tests.services.test_prefill_transfer import wait_idle

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


def _chunks(rid: str, prompt: list[int], r: decode_pb2.ReserveResponse) -> list[prefill_pb2.PrefillChunk]:
    header = prefill_pb2.PrefillHeader(
        decode_address=r.kv_transfer_address, dest_block_ids=r.dest_block_ids, num_skip_tokens=r.num_cached_tokens,
        num_prompt_tokens=len(prompt), sampling=sampling_params_from_dict({"temperature": 0.0, "max_tokens": 8}),
        compatibility_hash=r.compatibility_hash, lease_deadline_unix_ms=r.lease_deadline_unix_ms,
    )  # fmt: skip
    return [prefill_pb2.PrefillChunk(request_id=rid, chunk_index=i, token_ids=prompt[s:s + 32],
                                     is_last=s + 32 >= len(prompt), header=header if i == 0 else None)
            for i, s in enumerate(range(0, len(prompt), 32))]  # fmt: skip


def test_abort_while_kv_is_in_flight_frees_both_sides(tiny_model):
    prompt = random_prompts([200], vocab=512, seed=41)[0]

    async def main():
        decode = await serve_decode(decode_settings(tiny_model, lease_s=600.0))
        prefill = await serve_prefill(prefill_settings(tiny_model, budget=32, model_id=MODEL_ID), grpc_port=0)
        d_chan, p_chan = grpc.aio.insecure_channel(decode.address), grpc.aio.insecure_channel(prefill.address)
        d_stub, p_stub = decode_pb2_grpc.DecodeStub(d_chan), prefill_pb2_grpc.PrefillStub(p_chan)
        entered, release = threading.Event(), threading.Event()

        def hold(engine) -> None:
            entered.set()
            release.wait(120)

        try:
            r = await d_stub.Reserve(decode_pb2.ReserveRequest(request_id="flight", prompt_token_ids=prompt))
            assert r.status == decode_pb2.RESERVE_STATUS_RESERVED, r.message
            generate = d_stub.Generate(decode_request("flight", prompt, 8, remote=True))
            reading = asyncio.ensure_future(generate.read())
            await poll_until(lambda: decode.table.pending["flight"].attached, "decode's Generate attached")
            held = asyncio.ensure_future(decode.loop.call(hold))
            await poll_until(entered.is_set, "decode's engine thread is held")
            prefilling = p_stub.Prefill(iter(_chunks("flight", prompt, r)))
            progress = asyncio.ensure_future(prefilling.read())
            # A piece is inside decode, its write queued behind the held engine: KV in flight.
            await poll_until(lambda: decode.table.pending["flight"].first_piece_at is not None, "a piece reached decode")
            for call in (generate, prefilling):
                call.cancel()
            await p_stub.Abort(common_pb2.AbortRequest(request_id="flight"))  # prefill's engine is not held
            d_abort = asyncio.ensure_future(d_stub.Abort(common_pb2.AbortRequest(request_id="flight")))
            await poll_until(lambda: "flight" in decode.table.aborted or "flight" not in decode.table.pending,
                             "decode handled the abort up to its engine")
            release.set()
            await held
            await d_abort
            await asyncio.gather(reading, progress, return_exceptions=True)
            await wait_idle(prefill.engine_loop, timeout=30)
            await wait_idle(decode.loop, timeout=30)
            await poll_until(lambda: not decode.table.pending, "decode's table is empty")
            d_load = await d_stub.GetLoad(common_pb2.GetLoadRequest(check_integrity=True))
            p_load = await p_stub.GetLoad(common_pb2.GetLoadRequest(check_integrity=True))
            return d_load, p_load
        finally:
            release.set()
            await d_chan.close()
            await p_chan.close()
            await prefill.stop()
            await decode.stop()

    d_load, p_load = asyncio.run(main())
    assert d_load.num_free_blocks == d_load.num_total_blocks and not d_load.kv_integrity_error, d_load
    assert p_load.num_free_blocks == p_load.num_total_blocks and not p_load.kv_integrity_error, p_load
    assert p_load.num_running == 0 and p_load.num_transfers_in_flight == 0, p_load
