"""The Decode gRPC service: protobuf in, domain calls, protobuf out (see decode.proto)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from common.engine.llm_engine import RequestError
from common.kv_cache.prefix_hash import compute_block_hashes
from common.kv_transfer.compat import KVLayout
from common.sampling.params import SamplingParamsError
from services.decode.convert import Draining, InvalidField, ResponseBuilder, decode_call_from_proto, grpc_status
from services.decode.remote_kv import RemoteKVTable, ReserveAborted
from services.decode.request_trace import GenerateTrace
from services.decode.runner import RequestRunner, RunInfo
from services.runtime import tracing
from services.runtime.engine_loop import EngineLoop
from services.runtime.routing import RecentPrefixes
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)
Reserve = decode_pb2.ReserveStatus


@dataclass
class WorkerState:
    """What the servicers share besides the engine."""

    kv_transfer_address: str
    layout: KVLayout
    recent_prefixes: RecentPrefixes
    draining: bool = False
    trace_links: dict = field(default_factory=dict)
    """request id -> span context of its traced Generate call (for the draft proposer's links)."""

    def remember_prompt(self, prompt_token_ids: list[int]) -> None:
        depth = self.recent_prefixes.depth
        self.recent_prefixes.add(compute_block_hashes(prompt_token_ids[: depth * self.layout.block_size], self.layout.block_size))


async def load_snapshot(loop: EngineLoop, table: RemoteKVTable, draining: bool,
                        check_integrity: bool = False) -> decode_pb2.DecodeLoad:  # fmt: skip
    def read(engine) -> tuple[int, int, int, int, str]:
        error = engine.kv.integrity_error() if check_integrity else ""
        return engine.kv.num_free_blocks, engine.kv.num_blocks, engine.scheduler.num_running, engine.scheduler.num_waiting, error

    free, total, running, waiting, error = await loop.call(read)
    return decode_pb2.DecodeLoad(
        num_free_blocks=free, num_total_blocks=total, num_running=running, num_waiting=waiting,
        num_reserved_blocks=table.num_reserved_blocks, num_waiting_for_kv=table.num_waiting_for_kv,
        block_size=table.layout.block_size, draining=draining, kv_integrity_error=error,
    )  # fmt: skip


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, table: RemoteKVTable, runner: RequestRunner, state: WorkerState) -> None:
        self.loop, self.table, self.runner, self.state = loop, table, runner, state

    async def Reserve(self, request: decode_pb2.ReserveRequest, context) -> decode_pb2.ReserveResponse:
        response, _ = await self._traced_reserve(request, context)
        return response

    async def ReserveAndHold(self, request: decode_pb2.ReserveRequest, context):
        response, pending = await self._traced_reserve(request, context)
        if pending is not None:
            # However the call ends (a dead caller's connection closes, which cancels it, even
            # while this answer is being sent): a reservation no Generate claimed is freed now.
            context.add_done_callback(lambda _: self.table.release_hold(
                pending, "its ReserveAndHold call ended before a Generate claimed it"))
        yield response
        if pending is not None:
            await pending.claimed_or_ended.wait()

    async def _traced_reserve(self, request: decode_pb2.ReserveRequest, context):
        """(the answer, the reservation when RESERVED else None)."""
        with tracing.span("decode.reserve", tracing.context_from_grpc(context), kind=tracing.SpanKind.SERVER) as span:
            response, pending = await self._reserve(request, context)
            if span.is_recording():
                tracing.set_attributes(span, {
                    "tandem.request_id": request.request_id, "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                    "tandem.reserve.status": Reserve.Name(response.status), "tandem.num_cached_tokens": response.num_cached_tokens,
                    "tandem.num_dest_blocks": len(response.dest_block_ids),
                })  # fmt: skip
            return response, pending

    async def _reserve(self, request: decode_pb2.ReserveRequest, context):
        layout_hash = self.state.layout.compatibility_hash()
        if self.state.draining:
            return decode_pb2.ReserveResponse(status=Reserve.RESERVE_STATUS_DRAINING, message="decode worker is draining"), None
        if request.compatibility_hash and request.compatibility_hash != layout_hash:
            return decode_pb2.ReserveResponse(
                status=Reserve.RESERVE_STATUS_INCOMPATIBLE, compatibility_hash=layout_hash,
                message=f"compatibility_hash {request.compatibility_hash!r} != this worker's {layout_hash!r}",
            ), None  # fmt: skip
        if not request.request_id:
            await _abort(context, InvalidField("request_id", "must be non-empty"))
        if not request.prompt_token_ids:
            await _abort(context, InvalidField("prompt_token_ids", "the prompt is empty"))
        prompt = list(request.prompt_token_ids)
        try:
            pending = await self.table.reserve(request.request_id, prompt, request.lease_ms)
        except ReserveAborted as e:
            await context.abort(grpc.StatusCode.CANCELLED, str(e))
        except RequestError as e:
            if e.field in ("prompt", "max_tokens") and prompt:  # too long for the context or the cache
                return decode_pb2.ReserveResponse(status=Reserve.RESERVE_STATUS_TOO_LONG, message=str(e)), None
            await _abort(context, e)
        if pending is None:
            load = await load_snapshot(self.loop, self.table, self.state.draining)
            return decode_pb2.ReserveResponse(
                status=Reserve.RESERVE_STATUS_NO_CAPACITY,
                message=f"need {-(-len(prompt) // self.state.layout.block_size)} blocks, {load.num_free_blocks} free, "
                        f"{load.num_running} running (max {self.loop.engine.config.scheduler.max_num_seqs})",
            ), None  # fmt: skip
        # No await from here on: a handler cancelled now would leave the reservation to its
        # ReserveAndHold call's end (or the gateway's Abort, or the lease), not to this call.
        self.state.remember_prompt(prompt)
        return decode_pb2.ReserveResponse(
            status=Reserve.RESERVE_STATUS_RESERVED,
            num_cached_tokens=pending.num_cached_tokens,
            dest_block_ids=pending.dest_block_ids,
            block_size=self.state.layout.block_size,
            lease_deadline_unix_ms=pending.deadline_unix_ms,
            kv_transfer_address=self.state.kv_transfer_address,
            compatibility_hash=layout_hash,
        ), pending

    async def Generate(self, request: decode_pb2.DecodeRequest, context):
        try:
            call = decode_call_from_proto(request)
            if self.state.draining and not call.remote:
                raise Draining("decode worker is draining; send the request to another worker")
        except (InvalidField, SamplingParamsError, Draining) as e:
            if request.kv_source == decode_pb2.KV_SOURCE_REMOTE:  # its reservation has no other user
                self.table.drop_unclaimed(request.request_id, f"its Generate was refused: {e}")
            await _abort(context, e)
        if not call.remote:
            self.state.remember_prompt(call.prompt_token_ids)
        info = RunInfo()
        builder = None
        started = time.monotonic()
        trace = GenerateTrace(context, call, self.state.trace_links)
        try:
            async for out in self.runner.run(call, info):
                trace.on_output(out)
                if builder is None:
                    builder = self._builder(call, info)
                builder.cached_tokens = max(builder.cached_tokens, info.prefill_cached_tokens)
                yield builder.response(out)
        except Exception as e:  # mapped to a status in one place
            trace.fail(e)
            if not isinstance(e, (InvalidField, RequestError)):
                logger.warning("Generate %s failed: %s", call.request_id, e)
            await _abort(context, e)
        finally:
            trace.end(info)
        builder = builder or self._builder(call, info)
        builder.cached_tokens = max(builder.cached_tokens, info.prefill_cached_tokens)
        yield builder.closing()
        logger.debug("Generate %s done in %.3f s", call.request_id, time.monotonic() - started)

    @staticmethod
    def _builder(call, info: RunInfo) -> ResponseBuilder:
        source = decode_pb2.KV_SOURCE_REMOTE if info.remote_kv_used else decode_pb2.KV_SOURCE_LOCAL
        return ResponseBuilder(call.request_id, len(call.prompt_token_ids), call.params.n,
                               call.params.logprobs is not None, source)  # fmt: skip

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        self.table.mark_aborted(request.request_id)
        reserved = self.table.fail(request.request_id, request.reason or "aborted", aborted=True)
        running = await self.loop.abort(request.request_id)
        return common_pb2.AbortResponse(aborted=reserved or running)

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context) -> decode_pb2.DecodeLoad:
        return await load_snapshot(self.loop, self.table, self.state.draining, request.check_integrity)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = grpc_status(exc)
    await context.abort(code, message)
