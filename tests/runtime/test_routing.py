"""Routing policy: pure functions over WorkerInfo records."""

from __future__ import annotations

import dataclasses

import pytest

from services.runtime.registry import EXTRA_PREFIX_HASHES, WorkerInfo
from services.runtime.routing import (
    AffinityCache,
    AffinityIndex,
    PendingAssignments,
    RecentPrefixes,
    RoutingConfig,
    pick_decode,
    pick_prefill,
)


def decode(wid: str, free: int, total: int = 100, running: int = 0, hashes: list[int] | None = None,
           model: str = "m", updated_at: float = 100.0) -> WorkerInfo:
    extra: dict = {}
    if hashes is not None:
        prefixes = RecentPrefixes()
        prefixes.add(hashes)
        extra = prefixes.to_extra()
    return WorkerInfo(wid, "decode", "127.0.0.1:1", model, kv_blocks_free=free, kv_blocks_total=total,
                      num_running=running, updated_at=updated_at, extra=extra)


def prefill(wid: str, queued: int, waiting: int = 0, model: str = "m") -> WorkerInfo:
    return WorkerInfo(wid, "prefill", "127.0.0.1:2", model, queued_tokens=queued, num_waiting=waiting)


PROMPT = [11, 22, 33, 44, 55]  # chained block hashes of a 5-full-block prompt


def test_decode_most_free_blocks() -> None:
    workers = [decode("a", 10), decode("b", 50), decode("c", 30), prefill("p", 0)]
    assert pick_decode(workers, PROMPT).worker_id == "b"


def test_decode_skips_workers_without_room_and_returns_none_when_full() -> None:
    workers = [decode("a", 5), decode("b", 7)]
    assert pick_decode(workers, PROMPT).worker_id == "b"  # needs 5 full + 1 partial = 6
    assert pick_decode(workers, PROMPT, blocks_needed=8) is None
    assert pick_decode([], PROMPT) is None
    assert pick_decode([prefill("p", 0)], PROMPT) is None


def test_decode_prefix_affinity() -> None:
    workers = [decode("a", 50), decode("b", 48, hashes=PROMPT[:3])]
    index = AffinityIndex.from_workers(workers)
    assert index.matched_blocks("b", PROMPT) == 3
    assert index.matched_blocks("a", PROMPT) == 0
    # 48 free + 3 held beats 50 free + 0 held.
    assert pick_decode(workers, PROMPT, index).worker_id == "b"
    # Affinity is worth only the blocks saved: a much emptier worker still wins.
    workers = [decode("a", 80), decode("b", 48, hashes=PROMPT[:3])]
    assert pick_decode(workers, PROMPT, AffinityIndex.from_workers(workers)).worker_id == "a"
    # ...unless the weight says otherwise.
    heavy = RoutingConfig(affinity_weight=20.0)
    assert pick_decode(workers, PROMPT, AffinityIndex.from_workers(workers), config=heavy).worker_id == "b"


def test_decode_affinity_with_real_chained_hashes() -> None:
    from common.kv_cache.prefix_hash import compute_block_hashes

    served = compute_block_hashes(list(range(64)), block_size=16)  # 4 blocks
    same_start = compute_block_hashes(list(range(32)) + [7] * 32, block_size=16)  # shares 2 blocks
    other_start = compute_block_hashes([5] + list(range(1, 64)), block_size=16)  # differs in block 0
    workers = [decode("a", 50), decode("b", 50, hashes=served)]
    index = AffinityIndex.from_workers(workers)
    assert index.matched_blocks("b", served) == 4
    assert index.matched_blocks("b", same_start) == 2
    assert index.matched_blocks("b", other_start) == 0  # chained: block 0 differs, nothing matches
    assert pick_decode(workers, same_start, index).worker_id == "b"
    assert pick_decode(workers, other_start, index).worker_id == "a"


def test_decode_ties_are_deterministic() -> None:
    workers = [decode("b", 50, running=1), decode("c", 50), decode("a", 50)]
    assert pick_decode(workers, PROMPT).worker_id == "a"
    workers = [decode("a", 50, running=2), decode("b", 50, running=1)]
    assert pick_decode(workers, PROMPT).worker_id == "b"  # fewer running requests first
    assert pick_decode(list(reversed(workers)), PROMPT).worker_id == "b"


def test_decode_model_and_exclude_filters() -> None:
    workers = [decode("a", 90, model="other"), decode("b", 50), decode("c", 40)]
    assert pick_decode(workers, PROMPT, model="m").worker_id == "b"
    assert pick_decode(workers, PROMPT, model="m", exclude={"b"}).worker_id == "c"


def test_affinity_index_tolerates_bad_extra() -> None:
    bad = WorkerInfo("x", "decode", "h:1", "m", extra={EXTRA_PREFIX_HASHES: "notalist"})
    worse = WorkerInfo("y", "decode", "h:1", "m", extra={EXTRA_PREFIX_HASHES: ["zz", None, "0b"]})
    index = AffinityIndex.from_workers([bad, worse])
    assert index.matched_blocks("y", [11]) == 1
    assert index.matched_blocks("x", [11]) == 0


def test_affinity_cache_rebuilds_only_when_a_record_changes() -> None:
    cache = AffinityCache()
    a, b = decode("a", 10, hashes=[1, 2]), decode("b", 10, hashes=[7])
    first = cache.of([a, b])
    assert first.matched_blocks("a", [1, 2]) == 2
    assert cache.of([a, b]) is first  # the same records (a registry view between refreshes)
    refreshed = decode("a", 10, hashes=[1, 2, 3])  # the next refresh: new records, a longer prefix
    again = cache.of([refreshed, b])
    assert again is not first and again.matched_blocks("a", [1, 2, 3]) == 3
    assert cache.of([b]).matched_blocks("a", [1, 2, 3]) == 0  # a worker gone


def test_recent_prefixes_bounded_lru() -> None:
    prefixes = RecentPrefixes(max_hashes=4, depth=2)
    prefixes.add([1, 2, 3])  # only the first `depth` are kept
    prefixes.add([5, 6])
    prefixes.add([1, 9])  # 1 refreshed; 2 is now the oldest
    assert len(prefixes) == 4
    assert prefixes.to_extra() == {EXTRA_PREFIX_HASHES: [format(h, "016x") for h in (5, 6, 1, 9)]}
    prefixes.add([2**64 - 1])
    assert prefixes.to_extra()[EXTRA_PREFIX_HASHES][-1] == "ffffffffffffffff"
    assert len(prefixes) == 4
    with pytest.raises(ValueError):
        RecentPrefixes(max_hashes=0)


def test_prefill_fewest_queued_tokens() -> None:
    workers = [prefill("a", 300), prefill("b", 100), prefill("c", 200), decode("d", 10)]
    assert pick_prefill(workers).worker_id == "b"
    assert pick_prefill(workers, exclude={"b"}).worker_id == "c"
    assert pick_prefill([prefill("b", 0, waiting=2), prefill("c", 0, waiting=1)]).worker_id == "c"
    assert pick_prefill([prefill("b", 0), prefill("a", 0)]).worker_id == "a"
    assert pick_prefill([decode("d", 10)]) is None
    assert pick_prefill([prefill("a", 0, model="x")], model="m") is None


def test_pending_assignments_spread_a_burst() -> None:
    workers = [decode("a", 50, updated_at=100.0), decode("b", 49, updated_at=100.0)]
    pending = PendingAssignments()
    picks = []
    for i in range(6):
        choice = pick_decode(pending.apply(workers, now=101.0), PROMPT)
        picks.append(choice.worker_id)
        pending.add(choice.worker_id, blocks=6, now=101.0 + i * 0.01)
    assert picks == ["a", "b", "a", "b", "a", "b"]
    # Once a worker's heartbeat is newer than the assignments, they stop counting.
    fresh = [decode("a", 32, updated_at=102.0), decode("b", 49, updated_at=100.0)]
    adjusted = {w.worker_id: w for w in pending.apply(fresh, now=102.5)}
    assert adjusted["a"].kv_blocks_free == 32
    assert adjusted["b"].kv_blocks_free == 49 - 18 and adjusted["b"].num_waiting == 3
    assert len(pending) == 3
    assert pending.apply(fresh, now=200.0) == fresh  # expired after max_age_s


def test_a_heartbeat_whose_load_was_read_before_the_burst_keeps_the_claims() -> None:
    """Defect 4 of issue 11: a heartbeat written after a burst but with load numbers read before
    it (the engine was busy with a long step) used to erase every claim: all 16 went to one."""
    pending = PendingAssignments()
    workers = [decode("a", 50, updated_at=100.0), decode("b", 50, updated_at=100.0)]
    picks = []
    for i in range(16):
        # Heartbeats land meanwhile, written at 101.x (after the claims), their loads read at 100.5.
        seen = [dataclasses.replace(w, updated_at=101.0 + i, load_at=100.5) for w in workers]
        choice = pick_decode(pending.apply(seen, now=100.6 + i * 0.01), PROMPT)
        picks.append(choice.worker_id)
        pending.add(choice.worker_id, blocks=6, now=100.6 + i * 0.01)
    assert picks.count("a") == 8 and picks.count("b") == 8
    # A load read after the claims (load_at newer) already holds them: they stop counting.
    later = [dataclasses.replace(w, load_at=102.0) for w in workers]
    assert pending.apply(later, now=102.5) == later and len(pending) == 0
