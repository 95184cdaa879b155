"""Decode's side of remote KV: reservations, the checks every pushed piece passes, the outcome.

Life of a remote request on decode (one `PendingTransfer` each, keyed by request id):

    Reserve ──> WAITING (blocks held, lease running; ReserveAndHold: also held by that call)
      PushKV piece verified + written ──> TRANSFERRING (lease renewed)
      last piece (is_last + first token) ──> SUCCESS, `done` resolves with the first token ─┐
    Generate(REMOTE) attaches, any time ───────────────────────────────────────────────────┴─>
      both there: the Generate handler commits and the request runs
    rejected piece | stream ended early | lease expired | Abort ──> FAILED(reason)
      a Generate is attached: `done` raises TransferFailed, its policy decides (recompute / fail)
      no Generate yet: the blocks are freed now; a later Generate finds the reason in `failures`

Who frees what when a request's owner leaves early (docs/cluster.md, "Who frees a reservation"):
a Reserve cancelled inside the engine releases what the engine reserved; an Abort that overtook
its Reserve (the id is in `aborted` when the engine answers) makes the Reserve free and answer
CANCELLED; a Generate refused or cancelled before attaching drops the reservation
(`drop_unclaimed`); a ReserveAndHold call that ends before a Generate claimed the reservation
(its caller cancelled it or died: a dead process's connection closes, which cancels the call)
drops it (`release_hold`); `free_orphans` is the backstop for engine reservations nobody owns.

A piece is written only after every check passed, so a corrupt or foreign piece never reaches
the cache. Everything here runs on the asyncio loop (no locks); the engine is touched only
through `EngineLoop.call`, whose commands run in order (an abort queued before an add lands first).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from common.engine.llm_engine import RequestError, Reservation
from common.kv_transfer.codec import KVChecksumError, KVChunkData, KVChunkError, chunk_tensor, validate_chunk
from common.kv_transfer.compat import KVLayout
from common.kv_transfer.state import KVTransferState, KVTransferTracker
from common.sampling.params import SamplingParams
from services.runtime.engine_loop import EngineLoop
from services.runtime.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

# Reserve knows only the prompt: size and validate it for one output token (the Generate call's
# real params replace these at commit).
RESERVE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
MAX_REMEMBERED_FAILURES = 4096


class PieceStatus(enum.Enum):
    """Outcome of a PushKV stream (mirrors kv_transfer.proto's PushKVStatus)."""

    ACCEPTED = "accepted"
    UNKNOWN_REQUEST = "unknown_request"
    CHECKSUM_MISMATCH = "checksum"
    INCOMPATIBLE = "incompatible"
    INVALID = "invalid"
    INCOMPLETE = "incomplete"

    @property
    def metric_reason(self) -> str:
        """tandem_kv_transfer_failures_total{reason} (docs/deployment.md)."""
        return {"checksum": "checksum", "incompatible": "incompatible"}.get(self.value, "transport")


class PieceRejected(Exception):
    def __init__(self, status: PieceStatus, chunk_index: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status, self.chunk_index, self.reason = status, chunk_index, reason


class ReserveAborted(Exception):
    """An Abort for the request arrived while its Reserve was being made: nothing is held."""


class TransferFailed(Exception):
    """The remote KV of a request will not arrive intact; `aborted` = the client gave up."""

    def __init__(self, reason: str, aborted: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.aborted = reason, aborted


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill's first output token (sent on the last piece)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class PendingTransfer:
    request_id: str
    prompt_token_ids: list[int]
    dest_block_ids: list[int]
    """The reservation's blocks past decode's own prefix-cache hit, in position order."""
    writable_block_ids: frozenset[int]
    """The same blocks as a set: the only ones a piece may write."""
    num_cached_tokens: int
    lease_s: float
    deadline: float
    """time.monotonic() after which the reservation is freed."""
    done: asyncio.Future
    """Resolves with the FirstToken once every piece landed; raises TransferFailed on failure."""
    tracker: KVTransferTracker
    next_chunk_index: int = 0
    bytes_received: int = 0
    prefill_cached_tokens: int = 0
    attached: bool = False
    """A Generate call is waiting on `done` (it, not this table, then frees or commits)."""
    claimed_or_ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a Generate claimed the reservation or it ended: its ReserveAndHold call may close."""
    first_piece_at: float | None = None

    @property
    def deadline_unix_ms(self) -> int:
        return int((time.time() + self.deadline - time.monotonic()) * 1000)


@dataclass
class RemoteKVTable:
    """Every reservation of this decode worker, and the pieces' checks."""

    loop: EngineLoop
    layout: KVLayout
    default_lease_s: float
    metrics: ServiceMetrics | None = None
    vocab_size: int = 0
    """Token ids on the wire (first_tokens) must be below this; 0 = unchecked."""
    pending: dict[str, PendingTransfer] = field(default_factory=dict)
    reserving: set[str] = field(default_factory=set)
    """Ids whose Reserve is inside the engine right now (not in `pending` yet, but owned)."""
    _unowned_before: set[str] = field(default_factory=set)
    failures: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """Recently failed ids without a Generate attached -> reason (for a Generate that comes later)."""
    aborted: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Ids an Abort named since their Reserve or Generate began: the Reserve frees what it made, and
    a recompute fallback must not start for them."""

    # -- reserve / release --------------------------------------------------------------------
    async def reserve(self, request_id: str, prompt_token_ids: list[int], lease_ms: int = 0) -> PendingTransfer | None:
        """Holds blocks for the prompt; None when there is no room. Raises RequestError on bad input."""
        if request_id in self.pending or request_id in self.reserving:
            raise RequestError("request_id", f"{request_id!r} already holds a reservation")
        self.aborted.pop(request_id, None)  # only Aborts from now on count
        self.reserving.add(request_id)
        try:
            reservation: Reservation | None = await self.loop.call(
                lambda e: e.reserve_remote(request_id, prompt_token_ids, RESERVE_PARAMS)
            )
        except asyncio.CancelledError:
            # The caller left while the engine reserved: the engine may hold blocks nobody will
            # ever name again. Commands run in order, so this release lands after the reserve.
            self._release_in_engine(request_id)
            raise
        finally:
            self.reserving.discard(request_id)
        if reservation is None:
            return None
        if request_id in self.aborted:
            # An Abort overtook this Reserve: it found nothing to free yet, so free it here.
            self._release_in_engine(request_id)
            raise ReserveAborted(f"{request_id!r} was aborted while its Reserve was being made")
        lease_s = self.default_lease_s if lease_ms <= 0 else min(lease_ms / 1000, self.default_lease_s)
        skip = reservation.num_cached_tokens // self.layout.block_size
        dest = list(reservation.block_ids[skip:])
        pending = PendingTransfer(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            dest_block_ids=dest,
            writable_block_ids=frozenset(dest),
            num_cached_tokens=reservation.num_cached_tokens,
            lease_s=lease_s,
            deadline=time.monotonic() + lease_s,
            done=asyncio.get_running_loop().create_future(),
            tracker=KVTransferTracker(request_id),
        )
        pending.tracker.advance(KVTransferState.WAITING)
        self.pending[request_id] = pending
        self.failures.pop(request_id, None)
        return pending

    def fail(self, request_id: str, reason: str, *, metric_reason: str | None = None, aborted: bool = False) -> bool:
        """Ends a transfer that will not complete. True if the request held a reservation here."""
        pending = self.pending.get(request_id)
        if pending is None or pending.done.done() and pending.attached:
            return False  # unknown, or already committing
        if metric_reason and self.metrics is not None:
            self.metrics.kv_failures.labels(metric_reason).inc()
        pending.tracker.fail(reason)
        logger.info("KV transfer of %s failed: %s", request_id, reason)
        if pending.attached:
            pending.done.set_exception(TransferFailed(reason, aborted))
            return True
        # Nobody waits: free the blocks now and remember why for a Generate that comes later.
        self.drop(request_id, reason)
        if not aborted:
            self.failures[request_id] = reason
            while len(self.failures) > MAX_REMEMBERED_FAILURES:
                self.failures.popitem(last=False)
        return True

    def mark_aborted(self, request_id: str) -> None:
        self.aborted[request_id] = None
        while len(self.aborted) > MAX_REMEMBERED_FAILURES:
            self.aborted.popitem(last=False)

    def drop(self, request_id: str, reason: str) -> None:
        """Forgets the reservation and frees its blocks (its waiter, if any, is gone)."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.claimed_or_ended.set()
            pending.tracker.fail(reason)
            if not pending.done.done():
                pending.done.cancel()
        self._release_in_engine(request_id)

    def drop_unclaimed(self, request_id: str, reason: str) -> bool:
        """Frees a reservation no Generate has attached to (its Generate call was refused or
        cancelled before attaching: nobody else will use it). True if there was one."""
        pending = self.pending.get(request_id)
        if pending is None or pending.attached:
            return False
        logger.info("reservation of %s freed: %s", request_id, reason)
        self.drop(request_id, reason)
        return True

    def attach(self, pending: PendingTransfer) -> None:
        """A Generate call claims the reservation: from now on it frees or commits it."""
        pending.attached = True
        pending.claimed_or_ended.set()

    def release_hold(self, pending: PendingTransfer, reason: str) -> bool:
        """The reservation's ReserveAndHold call ended: frees it unless a Generate claimed it
        (or it already ended). True if it was freed here."""
        if self.pending.get(pending.request_id) is not pending:
            return False
        return self.drop_unclaimed(pending.request_id, reason)

    def _release_in_engine(self, request_id: str) -> None:
        # Fire and forget (this may run while a handler is being cancelled); commands run in order.
        # Only an uncommitted reservation is freed: a local recompute under the same id is not.
        task = asyncio.ensure_future(self.loop.call(lambda e: e.release_remote(request_id)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def free_orphans(self) -> list[str]:
        """Frees engine reservations that nothing here owns (not pending, not being reserved).

        Belt and braces behind the rules above: an id must be seen unowned by two sweeps in a row,
        because a Generate handler detaches an entry in the same loop step as it submits the
        commit, so a second sweep (submitted later, run later) can no longer see it reserved."""
        reserved = await self.loop.call(lambda e: e.reserved_request_ids())
        unowned = {rid for rid in reserved if rid not in self.pending and rid not in self.reserving}
        orphans = sorted(unowned & self._unowned_before)
        self._unowned_before = unowned - set(orphans)
        for rid in orphans:
            logger.warning("engine reservation of %s had no owner; freeing it", rid)
            self._release_in_engine(rid)
        return orphans

    def shorten_unclaimed_leases(self, seconds: float) -> int:
        """Drain: reservations no Generate claimed and no piece reached end within `seconds`."""
        deadline = time.monotonic() + seconds
        shortened = 0
        for p in self.pending.values():
            if not p.attached and p.next_chunk_index == 0 and p.deadline > deadline:
                p.deadline = deadline
                shortened += 1
        return shortened

    def detach(self, request_id: str) -> PendingTransfer | None:
        """Removes the entry (its Generate handler now owns the engine request)."""
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.claimed_or_ended.set()
        return pending

    def expire_due(self, now: float | None = None) -> list[str]:
        """Fails every reservation whose lease ran out; returns their ids."""
        now = time.monotonic() if now is None else now
        due = [p.request_id for p in self.pending.values() if p.deadline <= now and not (p.attached and p.done.done())]
        for request_id in due:
            self.fail(request_id, f"lease of {self.pending[request_id].lease_s:g} s expired before its KV arrived",
                      metric_reason="expired")  # fmt: skip
        return due

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(p.writable_block_ids) for p in self.pending.values() if not p.done.done())

    @property
    def num_waiting_for_kv(self) -> int:
        return sum(1 for p in self.pending.values() if not p.done.done())

    # -- pieces ---------------------------------------------------------------------------------
    def lookup(self, request_id: str, chunk_index: int) -> PendingTransfer:
        pending = self.pending.get(request_id)
        if pending is None or pending.done.done():
            reason = self.failures.get(request_id)
            detail = f" (it failed: {reason})" if reason else " (never reserved, expired, aborted or complete)"
            raise PieceRejected(PieceStatus.UNKNOWN_REQUEST, chunk_index, f"no reservation for {request_id!r}{detail}")
        return pending

    def check_piece(self, pending: PendingTransfer, chunk: KVChunkData, compatibility_hash: str) -> None:
        """Every check a piece must pass before it is written; raises PieceRejected naming the field."""
        where = f"chunk {chunk.chunk_index}"
        local_hash = self.layout.compatibility_hash()
        if compatibility_hash != local_hash:
            raise PieceRejected(PieceStatus.INCOMPATIBLE, chunk.chunk_index,
                                f"{where}: compatibility_hash {compatibility_hash!r} != this worker's {local_hash!r}")  # fmt: skip
        if chunk.dtype != self.layout.dtype:
            raise PieceRejected(PieceStatus.INCOMPATIBLE, chunk.chunk_index,
                                f"{where}: dtype {chunk.dtype!r} != this worker's {self.layout.dtype!r}")  # fmt: skip
        block_shape = (self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim)
        if len(chunk.shape) != 6 or tuple(chunk.shape[3:]) != block_shape:
            raise PieceRejected(PieceStatus.INCOMPATIBLE, chunk.chunk_index,
                                f"{where}: shape {list(chunk.shape)} does not end in [block_size, num_kv_heads, "
                                f"head_dim] = {list(block_shape)}")  # fmt: skip
        if chunk.chunk_index != pending.next_chunk_index:
            raise PieceRejected(PieceStatus.INVALID, chunk.chunk_index,
                                f"{where}: chunk_index expected {pending.next_chunk_index} (indices must not skip or repeat)")  # fmt: skip
        if len(set(chunk.block_ids)) != len(chunk.block_ids):
            raise PieceRejected(PieceStatus.INVALID, chunk.chunk_index, f"{where}: block_ids repeat a block")
        foreign = sorted(set(chunk.block_ids) - pending.writable_block_ids)
        if foreign:
            raise PieceRejected(PieceStatus.INVALID, chunk.chunk_index,
                                f"{where}: block_ids {foreign} are not among the reservation's dest_block_ids")  # fmt: skip
        try:
            validate_chunk(chunk, num_layers=self.layout.num_layers)
            chunk_tensor(chunk, verify=True)  # checksum before anything is written
        except KVChecksumError as e:
            raise PieceRejected(PieceStatus.CHECKSUM_MISMATCH, chunk.chunk_index, f"{where}: {e}") from None
        except KVChunkError as e:
            raise PieceRejected(PieceStatus.INVALID, chunk.chunk_index, f"{where}: {e}") from None

    def check_first_token(self, chunk_index: int, first: FirstToken) -> None:
        """A token id outside the vocabulary would break the engine step of every request here."""
        if not self.vocab_size:
            return
        ids = [("first_tokens[0].token_id", first.token_id)]
        ids += [(f"first_tokens[0].top_logprobs[{i}].token_id", t) for i, (t, _) in enumerate(first.top)]
        for name, token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise PieceRejected(PieceStatus.INVALID, chunk_index,
                                    f"{name}: {token_id} is outside the vocabulary [0, {self.vocab_size})")  # fmt: skip

    async def accept_piece(self, pending: PendingTransfer, chunk: KVChunkData, compatibility_hash: str,
                           first_tokens: list[FirstToken], prefill_cached_tokens: int) -> None:  # fmt: skip
        """Checks and writes one piece; on the last one completes the transfer. Raises PieceRejected."""
        self.check_piece(pending, chunk, compatibility_hash)
        if chunk.is_last and len(first_tokens) != 1:
            raise PieceRejected(PieceStatus.INVALID, chunk.chunk_index,
                                f"chunk {chunk.chunk_index}: the last piece must carry exactly one first_tokens entry, "
                                f"got {len(first_tokens)}")  # fmt: skip
        if chunk.is_last:
            self.check_first_token(chunk.chunk_index, first_tokens[0])
        if pending.first_piece_at is None:
            pending.first_piece_at = time.monotonic()
        if chunk.block_ids:
            data = chunk_tensor(chunk, verify=False)  # [layers, 2, n, block_size, kv_heads, head_dim]
            rid, ids = pending.request_id, list(chunk.block_ids)
            try:
                await self.loop.call(lambda e: e.write_remote_kv(rid, ids, chunk.layer_start, chunk.layer_end, data))
            except KeyError:  # aborted or expired while the piece was in flight
                raise PieceRejected(PieceStatus.UNKNOWN_REQUEST, chunk.chunk_index, f"no reservation for {rid!r}") from None
        if self.pending.get(pending.request_id) is not pending or pending.done.done():
            # Failed (abort, lease) while the write was queued: the blocks are already freed.
            raise PieceRejected(PieceStatus.UNKNOWN_REQUEST, chunk.chunk_index,
                                f"the reservation of {pending.request_id!r} ended during the transfer")  # fmt: skip
        if pending.tracker.state is KVTransferState.WAITING:
            pending.tracker.advance(KVTransferState.TRANSFERRING)
        pending.next_chunk_index += 1
        pending.bytes_received += chunk.num_bytes
        pending.deadline = time.monotonic() + pending.lease_s  # each accepted piece renews the lease
        if self.metrics is not None:
            self.metrics.kv_bytes.labels("recv").inc(chunk.num_bytes)
        if chunk.is_last:
            pending.prefill_cached_tokens = prefill_cached_tokens
            pending.tracker.advance(KVTransferState.SUCCESS)
            if self.metrics is not None:
                self.metrics.kv_seconds.labels("recv").observe(time.monotonic() - pending.first_piece_at)
            pending.done.set_result(first_tokens[0])
