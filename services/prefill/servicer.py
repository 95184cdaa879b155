"""The tandem.v1.Prefill gRPC edge: protobuf <-> domain, errors -> status codes. Logic lives in
prompt_intake (validation), prefill_runner (engine + transfer) and inflight (bookkeeping)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from services.prefill.errors import FailureKind, PrefillError, invalid
from services.prefill.inflight import InflightRequest, InflightTable
from services.prefill.kv_sender import KVSender
from services.prefill.prefill_runner import PrefillRunner, Progress
from services.prefill.prompt_intake import PrefillHeader, PromptAssembler, PromptChunk
from services.runtime import tracing
from services.runtime.engine_loop import EngineLoop
from services.runtime.kv_wire import sampling_params_to_dict
from tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


def chunk_from_proto(msg: prefill_pb2.PrefillChunk) -> PromptChunk:
    header = None
    if msg.HasField("header"):
        h = msg.header
        header = PrefillHeader(
            decode_address=h.decode_address,
            dest_block_ids=tuple(h.dest_block_ids),
            num_skip_tokens=h.num_skip_tokens,
            num_prompt_tokens=h.num_prompt_tokens,
            sampling=sampling_params_to_dict(h.sampling),
            compatibility_hash=h.compatibility_hash,
            lease_deadline_unix_ms=h.lease_deadline_unix_ms,
        )
    return PromptChunk(msg.request_id, msg.chunk_index, tuple(msg.token_ids), msg.is_last, header)


def progress_to_proto(request_id: str, p: Progress) -> prefill_pb2.PrefillProgress:
    return prefill_pb2.PrefillProgress(
        request_id=request_id, chunk_index=p.chunk_index, num_computed_tokens=p.num_computed_tokens,
        kv_bytes_sent=p.kv_bytes_sent, done=p.done, first_tokens=p.first_tokens,
        num_cached_tokens=p.num_cached_tokens, prompt_logprobs=p.prompt_logprobs,
    )  # fmt: skip


DRAIN_SECONDS = 1.0


async def _drain(request_iterator, seconds: float) -> None:
    """Reads (for at most `seconds`) what the client is still sending after a bad chunk, so the
    error status reaches it cleanly: aborting mid-upload races its writes, and gRPC can report
    that race as INTERNAL instead of our INVALID_ARGUMENT."""
    try:
        async with asyncio.timeout(seconds):
            async for _ in request_iterator:
                pass
    except Exception:  # noqa: BLE001 - a timeout or a broken stream: abort as planned either way
        pass


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, runner: PrefillRunner, table: InflightTable, engine_loop: EngineLoop, block_size: int) -> None:
        self.runner = runner
        self.table = table
        self.engine_loop = engine_loop
        self.block_size = block_size
        self.draining = False

    async def Prefill(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[prefill_pb2.PrefillProgress]:
        entry: InflightRequest | None = None
        intake_done = False
        span = tracing.start_span("prefill.request", tracing.context_from_grpc(context), kind=tracing.SpanKind.SERVER)
        try:
            if self.draining:
                raise PrefillError(FailureKind.UNAVAILABLE, "this prefill worker is draining; use another")
            assembler = PromptAssembler(self.block_size)
            async for msg in request_iterator:
                assembler.add(chunk_from_proto(msg))
                if entry is None:
                    entry = InflightRequest(assembler.request_id)
                    if not self.table.add(entry):
                        entry = None
                        raise invalid("request_id", f"{assembler.request_id!r} is already being prefilled here")
                entry.num_prompt_tokens = assembler.num_tokens
                if entry.failure is not None:
                    raise entry.failure
                if assembler.complete:
                    break
            intake_done = True
            job = assembler.finish()
            if span.is_recording():
                tracing.set_attributes(span, {"tandem.decode.address": job.header.decode_address,
                                              "tandem.num_skip_tokens": job.header.num_skip_tokens})
            run = self.runner.run(job, entry, tracing.context_of(span))
            try:
                async for progress in run:
                    yield progress_to_proto(job.request_id, progress)
            finally:
                await run.aclose()  # its cleanup (abort, cancel PushKV) runs now, not at GC
        except PrefillError as e:
            if e.kind is not FailureKind.ABORTED:
                logger.warning("prefill %s failed: %s", entry.request_id if entry else "?", e.message)
                tracing.mark_error(span, e.message)
            if not intake_done:
                await _drain(request_iterator, DRAIN_SECONDS)
            await context.abort(e.status_code, e.message)
        finally:
            if entry is not None:
                self.table.remove(entry)
                tracing.set_attributes(span, {"tandem.request_id": entry.request_id,
                                              "gen_ai.usage.input_tokens": entry.num_prompt_tokens})
            span.end()

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        entry = self.table.get(request.request_id)
        if entry is None:
            return common_pb2.AbortResponse(aborted=False)
        entry.fail(PrefillError(FailureKind.ABORTED, f"{request.request_id}: aborted ({request.reason or 'Abort rpc'})"))
        sender: KVSender | None = entry.sender
        if sender is not None:
            sender.cancel()
        await self.engine_loop.abort(request.request_id)  # blocks freed before this returns
        return common_pb2.AbortResponse(aborted=True)

    async def GetLoad(self, request, context) -> prefill_pb2.PrefillLoad:
        load = self.table.load()
        kv = self.engine_loop.engine.kv  # plain int reads; a step may be running meanwhile
        error = await self.engine_loop.call(lambda e: e.kv.integrity_error()) if request.check_integrity else ""
        return prefill_pb2.PrefillLoad(
            num_queued_tokens=load.num_queued_tokens, num_running=load.num_running,
            num_free_blocks=kv.num_free_blocks, num_total_blocks=kv.num_blocks,
            num_transfers_in_flight=load.num_transfers_in_flight, draining=self.draining, kv_integrity_error=error,
        )  # fmt: skip
