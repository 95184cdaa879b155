"""The gateway's side of defect 1 (issue 11): a client that leaves while `Decode.Reserve` is in
flight. The reservation is then owned by no attempt yet, so only the gateway's Reserve path can
free it; before the fix it stayed held until decode's lease ran out (30 s), or for ever when
decode's handler was cancelled inside the engine.

Each test forces its interleaving with a hook (the gateway's `after_reserve`, or decode's engine
thread held on an event) and cancels the client's gRPC call at that point. Decode's lease is
600 s, so only the abort rule can bring the pool back to baseline within the generous poll.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.engine.engine_helpers import random_prompts
from tests.services.decode_helpers import poll_until
from tests.services.gateway_helpers import MiniCluster

pytestmark = pytest.mark.timeout(240)
POLL_S = 30.0


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url)
    cluster.decode.table.default_lease_s = 600.0
    yield cluster
    cluster.close()


@pytest.fixture(autouse=True)
def back_to_baseline(mini):
    yield
    assert mini.decode_at_baseline(timeout=POLL_S), "decode kept blocks of a request whose client left"



def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                          sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))


async def _cancel_client_when(mini, prompt: list[int], reached) -> None:
    """Opens a streaming Generate on the disaggregated gateway, waits until `reached()`, cancels it."""
    port = mini.gateways["disaggregated"].grpc_port
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(_request(prompt))
        reading = asyncio.ensure_future(call.read())
        await poll_until(reached, "the request reached the interleaving under test")
        call.cancel()
        await asyncio.gather(reading, return_exceptions=True)


def test_client_leaves_while_the_reserve_reply_is_in_flight(mini):
    """Decode reserved and answered; the client is gone before the gateway made an attempt of it."""
    orchestrator = mini.gateways["disaggregated"].gateway.orchestrator
    parked, release = asyncio.Event(), asyncio.Event()

    async def after_reserve(internal_id: str) -> None:
        parked.set()
        await release.wait()

    async def go():
        orchestrator.after_reserve = after_reserve
        try:
            await _cancel_client_when(mini, random_prompts([40], vocab=1000, seed=31)[0], parked.is_set)
        finally:
            orchestrator.after_reserve = None
            release.set()

    mini.run(go, timeout=POLL_S * 3)


def test_client_leaves_while_decode_is_reserving(mini):
    """The client leaves while decode's engine is making the reservation (its thread held)."""
    table, loop = mini.decode.table, mini.decode.loop
    entered, release = threading.Event(), threading.Event()

    def hold(engine) -> None:
        entered.set()
        release.wait(POLL_S * 4)

    async def go():
        held = asyncio.ensure_future(loop.call(hold))
        try:
            await poll_until(entered.is_set, "decode's engine thread is held")
            seen: set[str] = set()

            def reserving() -> bool:
                seen.update(table.reserving)
                return bool(seen)

            await _cancel_client_when(mini, random_prompts([40], vocab=1000, seed=32)[0], reserving)
            # The gateway's Abort reaches decode while the Reserve is still inside the engine.
            await poll_until(lambda: seen <= set(table.aborted), "the gateway aborted the half-made reservation")
        finally:
            release.set()
            await held

    mini.run(go, timeout=POLL_S * 3)
