"""Runs one validated PrefillJob: engine + KV sender, yielding progress for the gateway.

    check compatibility (handshake once per decode) -> open PushKV -> engine.add_request(max_tokens=1)
    -> per step: Computed(end) -> Progress(num_computed, bytes sent)     (blocks ship meanwhile)
    -> first token sampled -> last piece (is_last, first_tokens) -> decode's verdict
    -> Progress(done, first token)

Any failure aborts the engine request (its blocks are freed within a step by EngineLoop.stream)
and cancels the PushKV stream; decode then frees or recomputes per its own rules.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.context import Context

from common.engine.llm_engine import CompletionOutput, RequestError
from common.kv_transfer.compat import KVLayout
from services.prefill.block_shipping import ShipCursor
from services.prefill.decode_directory import DecodeDirectory
from services.prefill.decode_peers import DecodePeers
from services.prefill.errors import FailureKind, PrefillError, invalid
from services.prefill.inflight import Computed, InflightRequest
from services.prefill.kv_sender import KVSender
from services.prefill.prompt_intake import PrefillJob
from services.runtime.engine_loop import EngineLoop
from services.runtime import tracing
from services.runtime.kv_wire import prompt_logprobs_to_proto, token_logprob_to_proto
from services.runtime.metrics import ServiceMetrics
from tandem.v1 import common_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Progress:
    chunk_index: int
    num_computed_tokens: int
    kv_bytes_sent: int
    done: bool = False
    first_tokens: list[common_pb2.TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


class PrefillRunner:
    def __init__(self, engine_loop: EngineLoop, peers: DecodePeers, layout: KVLayout, metrics: ServiceMetrics,
                 directory: DecodeDirectory | None = None) -> None:  # fmt: skip
        self.engine_loop = engine_loop
        self.peers = peers
        self.directory = directory or DecodeDirectory(None)
        self.layout = layout
        self.layout_hash = layout.compatibility_hash()
        self.metrics = metrics

    async def run(self, job: PrefillJob, entry: InflightRequest, trace: Context | None = None) -> AsyncIterator[Progress]:
        """trace: the prefill request span's context (None when tracing is off)."""
        rid, header = job.request_id, job.header
        succeeded = False
        try:
            try:  # bad ids or lengths are refused before any decode worker is dialed
                await self.engine_loop.call(lambda e: e.validate(job.prompt_token_ids, job.params))
            except RequestError as e:
                raise invalid(e.field, e.message) from None
            peer = await self._peer_for(job)
            if header.lease_deadline_unix_ms and time.time() * 1000 >= header.lease_deadline_unix_ms:
                raise PrefillError(FailureKind.LEASE_EXPIRED, f"{rid}: the decode reservation's lease ended before prefill could start")
            if entry.failure is not None:  # aborted while the prompt was arriving
                raise entry.failure
            entry.cursor = ShipCursor(self.layout.block_size, header.num_skip_tokens, header.dest_block_ids)
            entry.sender = KVSender(rid, peer, self.layout_hash, self.metrics, entry.fail, trace)
            entry.events = self.engine_loop.open_stream(rid)
            try:
                await self.engine_loop.prepare(job.params)  # grammar compile, off the engine thread
                await self.engine_loop.call(
                    lambda e: e.add_request(rid, params=job.params, prompt_token_ids=job.prompt_token_ids)
                )
            except RequestError as e:
                entry.fail(invalid(e.field, e.message))  # the stream below raises it and unregisters
            watchdog = self._arm_lease(job, entry)
            first: CompletionOutput | None = None
            chunk_start_ns, chunk_start_n = tracing.now_ns(), 0
            try:
                async for item in self.engine_loop.stream(rid, entry.events):
                    if isinstance(item, Computed):
                        n = item.num_computed_tokens
                        if trace is not None:  # one span per engine step that computed prompt tokens
                            now = tracing.now_ns()
                            tracing.record_span("prefill.chunk", trace, chunk_start_ns, now, {
                                "tandem.chunk_index": job.chunk_index_at(n), "tandem.num_computed_tokens": n,
                                "tandem.num_new_tokens": n - chunk_start_n})  # fmt: skip
                            chunk_start_ns, chunk_start_n = now, n
                        yield Progress(job.chunk_index_at(n), n, entry.sender.bytes_sent)
                    else:
                        first = item
            finally:
                if watchdog is not None:
                    watchdog.cancel()
            if first is None:
                raise entry.failure or PrefillError(FailureKind.ABORTED, f"{rid}: aborted")
            logprob, top = first.new_logprobs[0]
            token = token_logprob_to_proto(first.new_token_ids[0], logprob if job.params.logprobs is not None else 0.0, top or ())
            accepted = await entry.sender.finish([token], first.num_cached_tokens)
            succeeded = True
            yield Progress(len(job.chunk_ends) - 1, len(job.prompt_token_ids), accepted, True, [token], first.num_cached_tokens,
                           prompt_logprobs_to_proto(first.prompt_logprobs))
        except PrefillError as e:
            if e.metric_reason is not None:
                self.metrics.kv_failures.labels(reason=e.metric_reason).inc()
            if e.kind in (FailureKind.TRANSPORT, FailureKind.INCOMPATIBLE):
                self.peers.invalidate(header.decode_address)  # handshake again next time
            raise
        finally:
            if not succeeded:
                if entry.sender is not None:
                    entry.sender.cancel()
                if entry.events is not None:
                    # A failure injected into the stream does not abort the engine request by
                    # itself; shielded so a cancelled caller still frees the blocks.
                    await asyncio.shield(self.engine_loop.abort(rid))
            self.metrics.requests.labels(outcome="ok" if succeeded else "error").inc()

    async def _peer_for(self, job: PrefillJob):
        header = job.header
        if not await self.directory.allowed(header.decode_address):  # dial nobody a caller names at will
            raise invalid("header.decode_address", f"{header.decode_address!r} is not a decode worker registered in "
                                                   f"cluster {self.directory.cluster!r}")  # fmt: skip
        if header.compatibility_hash and header.compatibility_hash != self.layout_hash:
            # The hash alone cannot say what differs: the handshake's answer names each field.
            await self.peers.get(header.decode_address)
            raise PrefillError(
                FailureKind.INCOMPATIBLE,
                f"header.compatibility_hash: decode's KV layout hash {header.compatibility_hash} != prefill's "
                f"{self.layout_hash} ({self.layout})",
            )
        return await self.peers.get(header.decode_address)

    def _arm_lease(self, job: PrefillJob, entry: InflightRequest) -> asyncio.TimerHandle | None:
        deadline_ms = job.header.lease_deadline_unix_ms
        if not deadline_ms:
            return None

        def expire() -> None:
            if entry.sender is not None and entry.sender.num_pieces == 0:
                entry.fail(PrefillError(FailureKind.LEASE_EXPIRED, f"{job.request_id}: no KV pushed before the lease deadline"))

        return asyncio.get_running_loop().call_later(max(deadline_ms / 1000 - time.time(), 0.0), expire)
