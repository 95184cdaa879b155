"""Draft KV after a request finishes or aborts on decode (issue 11: draft KV stayed held ~60 s).

Two paths kept a sequence on the draft until its lease: a Propose whose caller's deadline passed
while it waited behind other work (the draft computed it anyway, for nobody), and Releases sent
while decode had dropped its stub after a failed Propose (they were discarded). Each test forces
its path with an explicit hold of the draft's worker thread; the lease is 600 s, so only the
release rules can bring the draft back to baseline within the generous poll.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from common.sampling.params import SamplingParams
from common.spec_decode.proposer import ProposalRequest
from services.decode.draft_client import DraftTargetInfo, RemoteDraftProposer
from tandem.v1 import draft_pb2, draft_pb2_grpc
from tests.services.decode_helpers import poll_until
from tests.services.test_draft_service import VOCAB, Pair

pytestmark = pytest.mark.timeout(240)
LEASE_S = 600.0
POLL_S = 30.0


@pytest.fixture(scope="module")
def pair(tiny_model):
    with Pair(tiny_model, tiny_model, lease_s=LEASE_S) as p:
        yield p


@pytest.fixture(autouse=True)
def back_to_baseline(pair):
    yield
    assert pair.draft_at_baseline(timeout=POLL_S), "the draft kept sequences of calls nobody waits for"


class Hold:
    """Holds the draft worker's thread in a call until release(): calls queue behind it."""

    def __init__(self, pair) -> None:
        self.pair, self.entered, self.gate = pair, threading.Event(), threading.Event()
        self.done = asyncio.run_coroutine_threadsafe(pair.draft.loop.call(self._hold), pair.dloop)
        assert self.entered.wait(POLL_S)

    def _hold(self, worker) -> None:
        self.entered.set()
        self.gate.wait(POLL_S * 4)

    def queued(self) -> int:
        return self.pair.draft.loop._pool._work_queue.qsize()

    def release(self) -> None:
        self.gate.set()
        self.done.result(POLL_S)


def _sequence(rid: str) -> draft_pb2.DraftSequence:
    return draft_pb2.DraftSequence(request_id=rid, reset=True, token_ids=[8, 9, 10, 11], num_context_tokens=4,
                                   num_draft_tokens=3)


def test_propose_whose_caller_gave_up_keeps_nothing(pair):
    hold = Hold(pair)
    try:
        async def late_call():
            async with grpc.aio.insecure_channel(pair.draft.address) as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [m async for m in stub.Propose(draft_pb2.ProposeRequest(sequences=[_sequence("late")]), timeout=0.3)]
                return info.value.code()

        assert pair.drun(late_call) == grpc.StatusCode.DEADLINE_EXCEEDED
        # The draft's handler was cancelled too: its release is queued behind the proposal.
        pair.drun(lambda: poll_until(lambda: hold.queued() >= 2, "the draft queued the release", POLL_S))
    finally:
        hold.release()


def test_releases_reach_the_draft_after_a_failed_propose(pair, tiny_model):
    """A Propose times out (the draft is busy); decode drops its proposing stub to rediscover,
    and a request that finishes meanwhile must still be released on the draft."""
    address = pair.draft.address
    proposer = RemoteDraftProposer(DraftTargetInfo.of_model(str(tiny_model), VOCAB), timeout_s=POLL_S,
                                   discover=lambda: [address])
    greedy = SamplingParams(temperature=0.0)
    try:
        assert proposer.propose([ProposalRequest("kept", [8, 9, 10, 11], 4, 3, greedy)])
        assert pair.draft.worker.num_sequences == 1
        hold = Hold(pair)
        try:
            proposer.timeout_s = 0.3
            assert proposer.propose([ProposalRequest("timed-out", [8, 9, 12], 3, 3, greedy)]) == {}
            assert proposer.num_failures == 1
        finally:
            hold.release()
        proposer.release(["kept"])  # "kept" finished on decode
        assert pair.draft_at_baseline(timeout=POLL_S), "a Release after the failure was lost"
    finally:
        proposer.close()
