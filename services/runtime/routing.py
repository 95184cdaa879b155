"""Who gets a request: pure policy over registry records (no Redis, no sockets).

    decode : most free KV blocks, plus a bonus for the prompt's leading blocks it likely holds
             (prefix affinity); workers without room for the prompt are skipped.
    prefill: fewest queued prompt tokens.
    ties   : fewer running+waiting requests, then worker_id, so the choice is deterministic.

Prefix affinity, in three small pieces:
  1. Decode worker: `RecentPrefixes` remembers the leading block hashes (the first `depth`
     chained hashes, see common/kv_cache/prefix_hash.py) of prompts it served recently, bounded
     to `max_hashes` (LRU), and publishes them in its heartbeat as
     `extra["prefix_hashes"]` = list of 16-digit hex strings.
  2. Router: `AffinityIndex.from_workers(workers)` inverts those lists: hash -> worker ids.
  3. Because hashes are chained, a worker holding h_k holds the whole prefix blocks 0..k, so
     the match is the largest k with h_k held. It is a hint: the blocks may have been evicted
     since; the decode worker's reservation is the real check.

Load numbers arrive once per heartbeat, so a burst of requests between two heartbeats would all
see the same "most free" worker. `PendingAssignments` lets a router count what it sent since
the load in each worker's record was read (`load_at`, stamped before the read; not `updated_at`,
which is later: a heartbeat whose engine read waited out a long step would otherwise erase the
claims of the whole burst routed meanwhile) and adjust the records before picking.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from services.runtime.registry import EXTRA_PREFIX_HASHES, Role, WorkerInfo


@dataclass(frozen=True)
class RoutingConfig:
    """Knobs of the pickers."""

    # How many free blocks one held leading prompt block is worth when scoring decode workers.
    # 1.0 = exactly the blocks the worker would not have to fill again; raise it to favour
    # affinity over balance.
    affinity_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.affinity_weight < 0:
            raise ValueError(f"affinity_weight must be >= 0, got {self.affinity_weight}")


def _hex(block_hash: int) -> str:
    return format(block_hash & 0xFFFF_FFFF_FFFF_FFFF, "016x")


class RecentPrefixes:
    """Decode-worker side: a bounded LRU of leading-block hashes of recently served prompts."""

    def __init__(self, max_hashes: int = 128, depth: int = 4) -> None:
        if max_hashes <= 0 or depth <= 0:
            raise ValueError(f"max_hashes and depth must be > 0, got {max_hashes}, {depth}")
        self.max_hashes = max_hashes
        self.depth = depth
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def add(self, prompt_block_hashes: Sequence[int]) -> None:
        """Record the first `depth` chained hashes of a prompt (most recent use wins)."""
        for block_hash in prompt_block_hashes[: self.depth]:
            self._hashes[block_hash] = None
            self._hashes.move_to_end(block_hash)
        while len(self._hashes) > self.max_hashes:
            self._hashes.popitem(last=False)

    def discard(self, block_hash: int) -> None:
        self._hashes.pop(block_hash, None)

    def __len__(self) -> int:
        return len(self._hashes)

    def to_extra(self) -> dict[str, list[str]]:
        """The heartbeat `extra` entry: {"prefix_hashes": [hex, ...]}, oldest first."""
        return {EXTRA_PREFIX_HASHES: [_hex(h) for h in self._hashes]}


class AffinityIndex:
    """Router side: block hash -> ids of the decode workers that published it."""

    def __init__(self, holders: dict[int, frozenset[str]] | None = None) -> None:
        self._holders: dict[int, frozenset[str]] = holders or {}

    @classmethod
    def from_workers(cls, workers: Iterable[WorkerInfo]) -> AffinityIndex:
        holders: dict[int, set[str]] = {}
        for worker in workers:
            published = worker.extra.get(EXTRA_PREFIX_HASHES) or []
            if not isinstance(published, list):
                continue  # tolerate a malformed extra: no affinity for that worker
            for text in published:
                try:
                    block_hash = int(text, 16)
                except (TypeError, ValueError):
                    continue
                holders.setdefault(block_hash, set()).add(worker.worker_id)
        return cls({h: frozenset(ids) for h, ids in holders.items()})

    def matched_blocks(self, worker_id: str, prompt_block_hashes: Sequence[int]) -> int:
        """Leading prompt blocks the worker likely holds: largest k with hash k-1 published."""
        for k in range(len(prompt_block_hashes), 0, -1):
            if worker_id in self._holders.get(prompt_block_hashes[k - 1], ()):
                return k
        return 0

    def __len__(self) -> int:
        return len(self._holders)


class AffinityCache:
    """The AffinityIndex of the worker records it was last asked about, built again only when one
    changed. A registry view hands out the same record objects until its next refresh (about once
    a second), so most requests find it built: rebuilding it for each one was ~4% of the gateway's
    CPU a request (tiny model, one stream, py-spy)."""

    def __init__(self) -> None:
        self._workers: tuple[WorkerInfo, ...] = ()
        self._index = AffinityIndex()

    def of(self, workers: Sequence[WorkerInfo]) -> AffinityIndex:
        if len(workers) != len(self._workers) or any(a is not b for a, b in zip(workers, self._workers)):
            self._workers, self._index = tuple(workers), AffinityIndex.from_workers(workers)
        return self._index


def _eligible(
    workers: Iterable[WorkerInfo], role: Role, model: str | None, exclude: Collection[str]
) -> list[WorkerInfo]:
    return [
        w for w in workers
        if w.role == role and w.worker_id not in exclude and (model is None or w.model == model)
    ]


def pick_decode(
    workers: Iterable[WorkerInfo],
    prompt_block_hashes: Sequence[int],
    affinity_index: AffinityIndex | None = None,
    *,
    blocks_needed: int | None = None,
    model: str | None = None,
    exclude: Collection[str] = (),
    config: RoutingConfig = RoutingConfig(),
) -> WorkerInfo | None:
    """The decode worker for a prompt, or None when no decode worker has room.

    blocks_needed: KV blocks the request needs on arrival; default len(prompt_block_hashes) + 1
    (the full blocks plus the partial last block). Room is checked against kv_blocks_free alone,
    without crediting held prefix blocks: free counts evictable cached blocks too, so a held
    prefix may already be counted there.
    exclude: worker ids to skip (e.g. ones whose reservation just failed).
    """
    needed = len(prompt_block_hashes) + 1 if blocks_needed is None else blocks_needed
    index = affinity_index or AffinityIndex()
    best: tuple[tuple[float, int, int, str], WorkerInfo] | None = None
    for worker in _eligible(workers, Role.DECODE, model, exclude):
        if worker.kv_blocks_free < needed:
            continue
        matched = index.matched_blocks(worker.worker_id, prompt_block_hashes)
        score = worker.kv_blocks_free + config.affinity_weight * matched
        key = (-score, -matched, worker.num_running + worker.num_waiting, worker.worker_id)
        if best is None or key < best[0]:
            best = (key, worker)
    return best[1] if best is not None else None


def pick_prefill(
    workers: Iterable[WorkerInfo],
    *,
    model: str | None = None,
    exclude: Collection[str] = (),
) -> WorkerInfo | None:
    """The prefill worker with the fewest queued tokens, or None when there is none."""
    candidates = _eligible(workers, Role.PREFILL, model, exclude)
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.queued_tokens, w.num_running + w.num_waiting, w.worker_id))


@dataclass(slots=True)
class _Assignment:
    worker_id: str
    at: float
    blocks: int
    tokens: int


class PendingAssignments:
    """What this router sent to each worker since the worker's last heartbeat.

    `apply(workers)` returns copies with those assignments folded in (fewer free blocks, more
    queued tokens, one more waiting request each). An assignment stops counting once the
    worker's load was read after it (the heartbeat already reflects it), or after max_age_s.
    Compares the router's clock with the workers' `updated_at`: fine on one host; across hosts
    it assumes synchronised clocks (NTP). Not thread-safe: use it from one event loop.
    """

    def __init__(self, max_age_s: float = 30.0) -> None:
        self.max_age_s = max_age_s
        self._assignments: list[_Assignment] = []

    def add(self, worker_id: str, *, blocks: int = 0, tokens: int = 0, now: float | None = None) -> _Assignment:
        assignment = _Assignment(worker_id, time.time() if now is None else now, blocks, tokens)
        self._assignments.append(assignment)
        return assignment

    def discard(self, assignment: _Assignment) -> None:
        """Withdraws a claim that did not turn into work (e.g. the worker refused a reservation)."""
        if assignment in self._assignments:
            self._assignments.remove(assignment)

    def apply(self, workers: Iterable[WorkerInfo], now: float | None = None) -> list[WorkerInfo]:
        now = time.time() if now is None else now
        by_id = {w.worker_id: w for w in workers}
        kept: list[_Assignment] = []
        for a in self._assignments:
            worker = by_id.get(a.worker_id)
            if now - a.at > self.max_age_s or (worker is not None and (worker.load_at or worker.updated_at) >= a.at):
                continue
            kept.append(a)
        self._assignments = kept
        adjusted: list[WorkerInfo] = []
        for worker in by_id.values():
            mine = [a for a in kept if a.worker_id == worker.worker_id]
            if not mine:
                adjusted.append(worker)
                continue
            adjusted.append(
                replace(
                    worker,
                    kv_blocks_free=max(0, worker.kv_blocks_free - sum(a.blocks for a in mine)),
                    queued_tokens=worker.queued_tokens + sum(a.tokens for a in mine),
                    num_waiting=worker.num_waiting + len(mine),
                )
            )
        return adjusted

    def __len__(self) -> int:
        return len(self._assignments)
