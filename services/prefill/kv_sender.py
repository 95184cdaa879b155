"""One request's PushKV stream to its decode worker, fed while the engine keeps computing.

    engine thread                          event loop (this module)            decode
    on_computed: read_blocks (a copy) ──▶  queue ──▶ encode in a worker thread
                 push_threadsafe()                   (split_kv: <= max payload,
                 returns at once                      xxh3 checksums)
                                                     await call.write(piece) ──▶ verify, write
    ...computes the next chunk...          ...
    servicer: finish(first_tokens) ─────▶  metadata-only last piece (is_last) ──▶ commit
                                           await the PushKVResponse ◀────────────

The engine thread never waits on the network: it only copies the blocks (they may be freed or
reused right after the step) and enqueues. Life cycle: KVTransferTracker
(BOOTSTRAPPING -> WAITING on start -> TRANSFERRING on the first piece -> SUCCESS | FAILED).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import torch
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from common.kv_transfer.codec import KVChunkData, payload_checksum, split_kv
from common.kv_transfer.state import KVTransferState, KVTransferTracker
from services.prefill.decode_peers import DecodePeer
from services.prefill.errors import FailureKind, PrefillError
from services.runtime import tracing
from services.runtime.kv_wire import chunk_to_proto
from services.runtime.metrics import ServiceMetrics
from tandem.v1 import common_pb2, kv_transfer_pb2

Status = kv_transfer_pb2.PushKVStatus

_REJECTION_KIND: dict[int, FailureKind] = {
    Status.PUSH_KV_STATUS_UNKNOWN_REQUEST: FailureKind.RESERVATION_GONE,
    Status.PUSH_KV_STATUS_CHECKSUM_MISMATCH: FailureKind.CORRUPT,
    Status.PUSH_KV_STATUS_INCOMPATIBLE: FailureKind.INCOMPATIBLE,
    Status.PUSH_KV_STATUS_INVALID: FailureKind.INTERNAL,
    Status.PUSH_KV_STATUS_INCOMPLETE: FailureKind.TRANSPORT,
}


@dataclass(frozen=True, slots=True)
class KVBatch:
    """Blocks copied out of the cache after a step, addressed to decode's blocks."""

    kv: torch.Tensor  # [num_layers, 2, len(dest_block_ids), block_size, kv_heads, head_dim]
    dest_block_ids: list[int]
    computed_at: float  # time.monotonic() when the step that computed them ended


@dataclass(frozen=True, slots=True)
class _Finish:
    first_tokens: Sequence[common_pb2.TokenLogprob]
    prefill_cached_tokens: int


class KVSender:
    def __init__(
        self,
        request_id: str,
        peer: DecodePeer,
        compatibility_hash: str,
        metrics: ServiceMetrics,
        on_failure: Callable[[PrefillError], None],
        trace: Context | None = None,
    ) -> None:
        self.request_id = request_id
        self.peer = peer
        self.compatibility_hash = compatibility_hash
        self.metrics = metrics
        self.tracker = KVTransferTracker(request_id)
        self.bytes_sent = 0
        self.num_pieces = 0
        self.max_piece_bytes = 0
        self.first_piece_sent_at: float | None = None
        self._on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[KVBatch | _Finish] = asyncio.Queue()
        # kv.transfer spans the whole PushKV stream; its context rides in the stream's metadata.
        self._span = tracing.start_span("kv.transfer", trace, kind=SpanKind.CLIENT)
        self._trace = tracing.context_of(self._span)
        self._call = peer.stub.PushKV(metadata=tracing.grpc_metadata(self._trace))
        self._task = self._loop.create_task(self._run(), name=f"kv-send-{request_id}")
        self._task.add_done_callback(self._report_early_failure)
        self._finishing = False
        self.tracker.advance(KVTransferState.WAITING)

    # -- producers ----------------------------------------------------------------------------
    def push_threadsafe(self, batch: KVBatch) -> None:
        """Engine thread: enqueue blocks to ship; returns at once."""
        self._loop.call_soon_threadsafe(self._queue.put_nowait, batch)

    async def finish(self, first_tokens: Sequence[common_pb2.TokenLogprob], prefill_cached_tokens: int) -> int:
        """Sends the last piece and waits for decode's verdict; returns the bytes decode accepted.
        Raises PrefillError if decode rejected anything or the stream broke."""
        self._finishing = True
        self._queue.put_nowait(_Finish(list(first_tokens), prefill_cached_tokens))
        return await self._task

    def cancel(self) -> None:
        """Abort: drop queued blocks and cancel the stream (decode sees it end without is_last)."""
        self.tracker.fail("aborted")
        self._task.cancel()
        self._call.cancel()

    @property
    def done(self) -> bool:
        return self._task.done()

    # -- the sending task -----------------------------------------------------------------------
    async def _run(self) -> int:
        try:
            return await self._send()
        except BaseException as e:  # CancelledError: aborted
            tracing.mark_error(self._span, e)
            raise
        finally:
            tracing.set_attributes(self._span, {"tandem.request_id": self.request_id, "tandem.kv.bytes": self.bytes_sent,
                                                "tandem.kv.num_pieces": self.num_pieces,
                                                "tandem.decode.address": self.peer.address})  # fmt: skip
            self._span.end()

    async def _send(self) -> int:
        next_index = 0
        try:
            while True:
                item = await self._queue.get()
                if isinstance(item, _Finish):
                    await self._write(self._last_piece(next_index), item)
                    await self._call.done_writing()
                    return self._verdict(await self._call)
                # Serialization (host copy, bytes, xxh3) off the event loop: it is the costly part.
                started_ns = tracing.now_ns()
                pieces = await asyncio.to_thread(
                    split_kv, item.kv, item.dest_block_ids, request_id=self.request_id,
                    first_chunk_index=next_index, is_final=False, max_payload_bytes=self.peer.max_payload_bytes,
                )  # fmt: skip
                for piece in pieces:
                    await self._write(piece)
                if self._trace is not None:
                    tracing.record_span("kv.send_chunk", self._trace, started_ns, tracing.now_ns(), {
                        "tandem.kv.bytes": sum(p.num_bytes for p in pieces), "tandem.kv.num_pieces": len(pieces),
                        "tandem.kv.num_blocks": len(item.dest_block_ids), "tandem.kv.first_piece_index": next_index,
                    })  # fmt: skip
                next_index += len(pieces)
                elapsed = time.monotonic() - item.computed_at
                self.metrics.kv_seconds.labels(direction="send").observe(elapsed)
        except PrefillError as e:
            self.tracker.fail(e.message)
            raise
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            # Decode may have answered early (a rejected piece): its verdict explains more.
            error = await self._early_verdict(e)
            self.tracker.fail(error.message)
            raise error from e

    async def _write(self, piece: KVChunkData, final: _Finish | None = None) -> None:
        msg = chunk_to_proto(
            piece, compatibility_hash=self.compatibility_hash,
            first_tokens=final.first_tokens if final else (),
            prefill_cached_tokens=final.prefill_cached_tokens if final else 0,
        )  # fmt: skip
        await self._call.write(msg)
        if self.num_pieces == 0:
            self.first_piece_sent_at = time.monotonic()
            self.tracker.advance(KVTransferState.TRANSFERRING)
        self.num_pieces += 1
        self.bytes_sent += piece.num_bytes
        self.max_piece_bytes = max(self.max_piece_bytes, msg.ByteSize())
        self.metrics.kv_bytes.labels(direction="send").inc(piece.num_bytes)

    def _last_piece(self, index: int) -> KVChunkData:
        # Metadata only (no blocks): every block was shipped after its step; this carries is_last
        # and token 0, which exists only once the last step sampled it.
        lay = self.peer.layout
        shape = (lay.num_layers, 2, 0, lay.block_size, lay.num_kv_heads, lay.head_dim)
        return KVChunkData(self.request_id, index, (), 0, lay.num_layers, lay.dtype, shape, b"", payload_checksum(b""), True)

    def _verdict(self, response: kv_transfer_pb2.PushKVResponse) -> int:
        if response.status == Status.PUSH_KV_STATUS_ACCEPTED:
            self.tracker.advance(KVTransferState.SUCCESS)
            return response.bytes_received
        kind = _REJECTION_KIND.get(response.status, FailureKind.INTERNAL)
        where = f" (piece {response.rejected_chunk_index})" if response.HasField("rejected_chunk_index") else ""
        raise PrefillError(
            kind, f"decode {self.peer.address} rejected the KV of {self.request_id!r}: "
            f"{Status.Name(response.status)}{where}: {response.reason}",
        )  # fmt: skip

    async def _early_verdict(self, error: Exception) -> PrefillError:
        with contextlib.suppress(Exception):
            response = await asyncio.wait_for(self._call, timeout=1.0)
            try:
                self._verdict(response)
            except PrefillError as rejected:
                return rejected
        detail = f"{error.code().name} {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else str(error)
        return PrefillError(FailureKind.TRANSPORT, f"PushKV to decode {self.peer.address} broke: {detail}")

    def _report_early_failure(self, task: asyncio.Task) -> None:
        # A failure before finish() (decode rejected a piece, the link broke) must stop the request
        # now, not when the prompt is done.
        if task.cancelled() or self._finishing:
            return
        error = task.exception()
        if error is not None and not isinstance(error, PrefillError):
            error = PrefillError(FailureKind.INTERNAL, f"KV sender of {self.request_id!r} failed: {error!r}")
        if error is not None:
            self._on_failure(error)
