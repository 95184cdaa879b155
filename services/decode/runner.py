"""Runs one Generate call on the engine: local prefill, or remote KV with its failure policy.

    LOCAL  ───────────────────────────────────────────────> add_request, stream outputs
    REMOTE ─ reservation? ─ no ─ failed earlier? ─ no ───> NoReservation (NOT_FOUND)
               │ yes                  │ yes: policy
               v                      v
          wait for the KV ── fails ─> RECOMPUTE: free the blocks, add_request (same id, same stream)
               │ lands                FAIL: free the blocks, raise TransferFailed (FAILED_PRECONDITION)
               v
          commit_remote (prefill's first token = output 0), stream outputs

Leaving the iterator early (client cancelled) aborts the request wherever it is, so its blocks
are freed within a step.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from common.engine.llm_engine import CompletionOutput
from services.decode.convert import DecodeCall, InvalidField, NoReservation
from services.decode.remote_kv import FirstToken, RemoteKVTable, TransferFailed
from services.runtime.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RunInfo:
    """What the caller reports besides the tokens."""

    remote_kv_used: bool = False
    prefill_cached_tokens: int = 0
    """Remote only: prompt tokens prefill took from its own prefix cache."""


class RequestRunner:
    def __init__(self, loop: EngineLoop, table: RemoteKVTable,
                 on_local_prefill: Callable[[int], None] | None = None) -> None:  # fmt: skip
        self.loop = loop
        self.table = table
        self.on_local_prefill = on_local_prefill
        """Called with the prompt tokens the engine computed itself (metrics)."""

    async def run(self, call: DecodeCall, info: RunInfo) -> AsyncIterator[CompletionOutput]:
        self.table.aborted.pop(call.request_id, None)  # a new call; only Aborts from now on count
        if not call.remote:
            async for out in self._local(call):
                yield out
            return
        rid = call.request_id
        try:  # fail fast on params the engine would refuse at commit, before waiting for any KV
            await self.loop.call(lambda e: e.validate(call.prompt_token_ids, call.params))
            await self.loop.prepare(call.params)  # compiles the grammar now, so commit never waits on it
        except BaseException as e:  # refused or cancelled: nobody else will use the reservation
            self.table.drop_unclaimed(rid, f"its Generate ended before waiting for the KV ({type(e).__name__})")
            raise
        pending = self.table.pending.get(rid)
        if pending is None:
            reason = self.table.failures.pop(rid, None)
            if reason is None:
                raise NoReservation(f"request_id: {rid!r} holds no reservation (never made, expired or aborted)")
            if call.fail_on_kv_error:
                raise TransferFailed(reason)
            logger.info("%s: remote KV failed earlier (%s); prefilling locally", rid, reason)
            async for out in self._local(call):
                yield out
            return
        if pending.prompt_token_ids != call.prompt_token_ids:
            self.table.drop(rid, "Generate's prompt differs from Reserve's")
            raise InvalidField("prompt_token_ids", "differs from the prompt given to Reserve for this request_id")
        if pending.attached:
            raise InvalidField("request_id", f"{rid!r} already has a Generate call")
        self.table.attach(pending)
        try:
            first: FirstToken = await pending.done
        except TransferFailed as failure:
            self.table.detach(rid)
            await self.loop.call(lambda e: e.abort_request(rid))  # frees the reserved blocks
            if failure.aborted or rid in self.table.aborted:
                return
            if call.fail_on_kv_error:
                raise
            logger.info("%s: remote KV failed (%s); prefilling locally", rid, failure.reason)
            async for out in self._local(call):
                yield out
            return
        except BaseException:  # cancelled while waiting for the KV
            self.table.drop(rid, "Generate call cancelled")
            raise
        self.table.detach(rid)
        info.remote_kv_used = True
        info.prefill_cached_tokens = pending.prefill_cached_tokens
        async for out in self._commit(call, first):
            yield out

    async def _local(self, call: DecodeCall) -> AsyncIterator[CompletionOutput]:
        first = True
        async for out in self.loop.generate(call.request_id, params=call.params, prompt_token_ids=call.prompt_token_ids,
                                            speculative=call.speculative,
                                            num_resumed_outputs=call.num_resumed_outputs):  # fmt: skip
            if first and self.on_local_prefill is not None:
                self.on_local_prefill(out.num_prompt_tokens - out.num_cached_tokens)
            first = False
            yield out

    async def _commit(self, call: DecodeCall, first: FirstToken) -> AsyncIterator[CompletionOutput]:
        rid, loop = call.request_id, self.loop
        top = first.top if call.params.logprobs is not None else None

        def commit(engine) -> bool:
            if not engine.is_unfinished(rid):
                return False  # aborted between the last piece and now
            loop.deliver([engine.commit_remote(rid, first.token_id, first.logprob, top, call.params)])
            if not call.speculative and rid in engine.scheduler.requests:
                engine.scheduler.requests[rid].spec_enabled = False  # opt-out (reservations default to on)
            return True

        q = loop.open_stream(rid)
        try:
            committed = await loop.call(commit)
        except BaseException:
            await loop.abort(rid)
            async for _ in loop.stream(rid, q):  # drains to the end marker; unregisters the stream
                pass
            raise
        if not committed:
            await loop.abort(rid)
        async for out in loop.stream(rid, q):
            yield out
