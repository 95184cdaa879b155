"""The Draft gRPC service (draft.proto): protobuf in, DraftWorker calls on its thread, protobuf out."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.kv_cache.kv_cache_manager import integrity_error
from services.runtime.draft_wire import InvalidField, prob_dtype_from_proto, proposal_to_proto, updates_from_proto
from services.draft.worker_loop import DraftLoop
from services.runtime import tracing
from tandem.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, loop: DraftLoop, model_id: str) -> None:
        self.loop = loop
        self.model_id = model_id
        self.draining = False

    async def GetInfo(self, request, context) -> draft_pb2.DraftInfo:
        w = self.loop.worker
        return draft_pb2.DraftInfo(model_id=self.model_id, vocab_size=w.vocab_size, tokenizer_hash=w.tokenizer_hash,
                                   max_num_draft_tokens=w.config.max_num_draft_tokens)  # fmt: skip

    async def Propose(self, request: draft_pb2.ProposeRequest, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draft worker is draining")
        w = self.loop.worker
        try:
            prob_dtype = prob_dtype_from_proto(request.prob_dtype)
            updates = updates_from_proto(request, w.vocab_size, w.config.max_num_draft_tokens)
        except InvalidField as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # A caller whose deadline passed has given up on this call and resets every sequence in it
        # next time: their draft KV is freed instead of kept for a reply nobody reads (or computed
        # at all, when the call waited behind others past its deadline on a loaded machine).
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        keys = [(u.request_id, u.choice_index) for u in updates]

        def propose(worker):
            if deadline is not None and time.monotonic() > deadline:
                worker.release(keys)
                return None
            results = worker.propose(updates, prob_dtype)
            if deadline is not None and time.monotonic() > deadline:
                worker.release(keys)
                return None
            return results

        with tracing.span("draft.propose", tracing.context_from_grpc(context), kind=tracing.SpanKind.SERVER) as span:
            try:
                results = await self.loop.call(propose)
            except asyncio.CancelledError:  # the caller left: its proposal (queued or running) is moot
                release = asyncio.ensure_future(self.loop.call(lambda worker: worker.release(keys)))
                release.add_done_callback(lambda t: t.cancelled() or t.exception())
                raise
            if results is None:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed before the proposal")
            replies = [proposal_to_proto(u, r, request.prob_dtype) for u, r in zip(updates, results)]
            if span.is_recording():
                tracing.set_attributes(span, {"tandem.num_sequences": len(updates), "tandem.step": request.step,
                                              "tandem.num_draft_tokens": sum(len(m.draft_token_ids) for m in replies)})
        for reply in replies:
            yield reply

    async def Release(self, request: draft_pb2.ReleaseRequest, context) -> draft_pb2.ReleaseResponse:
        keys = [(s.request_id, s.choice_index) for s in request.sequences]
        ids = list(request.request_ids)
        n = await self.loop.call(lambda worker: worker.release(keys, ids))
        return draft_pb2.ReleaseResponse(num_released=n)

    async def GetLoad(self, request, context) -> draft_pb2.DraftLoad:
        return await self.loop.call(lambda worker: load_of(worker, request.check_integrity))


def load_of(worker, check_integrity: bool = False) -> draft_pb2.DraftLoad:
    error = integrity_error(worker.check_integrity) if check_integrity else ""
    return draft_pb2.DraftLoad(num_sequences=worker.num_sequences, num_free_blocks=worker.kv.num_free_blocks,
                               num_total_blocks=worker.kv.num_blocks, kv_integrity_error=error)  # fmt: skip
