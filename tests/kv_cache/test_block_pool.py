"""BlockPool with exact block ids: allocation order, free order, LRU eviction, reuse, all-or-nothing."""

from __future__ import annotations

import pytest

from common.kv_cache.block_pool import BlockPool


def test_allocation_and_free_order_is_fifo():
    pool = BlockPool(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])  # returned on the right of the free list, in this order
    assert pool.allocate(4) == [3, 4, 1, 0]
    assert pool.num_free_blocks == 0
    pool.check_integrity()


def test_allocation_is_all_or_nothing():
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None  # only one left: nothing taken
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) is None
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_freed_hashed_blocks_stay_cached_and_are_evicted_lru_tail_first():
    pool = BlockPool(4)
    table = pool.allocate(3)
    assert table == [0, 1, 2]
    assert pool.cache_block(0, 100) and pool.cache_block(1, 101)  # block 2 stays unhashed (partial)
    pool.free(reversed(table))  # tail first: 2 -> free list; 1 then 0 -> LRU
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    pool.check_integrity()

    # Never-hashed blocks go first, so cached prefixes survive as long as possible.
    assert pool.allocate(2) == [3, 2]
    assert pool.num_evictions == 0
    # Then the LRU: the tail block 1 was freed first, so it is evicted first.
    assert pool.allocate(1) == [1]
    assert pool.num_evictions == 1
    assert pool.lookup(101) is None and pool.lookup(100) == 0
    pool.check_integrity()


def test_touch_revives_cached_block_and_removes_it_from_lru():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.free([b])
    assert pool.lookup(7) == b
    pool.touch([b])  # a prefix hit: back in use, no longer evictable
    assert pool.blocks[b].ref_count == 1
    assert pool.allocate(2) is None
    assert pool.allocate(1) == [1]
    pool.touch([b])  # shared: ref 2
    pool.free([b])
    assert pool.blocks[b].ref_count == 1 and pool.num_free_blocks == 0
    pool.free([b, 1])
    assert pool.num_free_blocks == 2
    pool.check_integrity()


def test_lru_order_follows_last_release():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, b in enumerate(ids):
        pool.cache_block(b, 1000 + i)
    pool.free([0])
    pool.free([1])
    pool.touch([0])  # block 0 used again ...
    pool.free([0])  # ... and released after 1, so 1 is now older
    pool.free([2])
    assert pool.allocate(1) == [1]
    assert pool.allocate(1) == [0]
    assert pool.allocate(1) == [2]
    assert pool.num_evictions == 3 and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_cache_block_keeps_existing_entry_for_duplicate_hash():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, 5)
    assert pool.cache_block(a, 5)  # idempotent
    assert not pool.cache_block(b, 5)  # another block holds it: keep the old mapping
    assert pool.lookup(5) == a and pool.blocks[b].block_hash is None
    with pytest.raises(AssertionError):
        pool.cache_block(a, 6)  # same block, new hash: content changed in place
    pool.free([b, a])
    assert list(pool._free) == [2, b]  # b was private: free list, not cache
    pool.check_integrity()


def test_uncache_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.uncache_block(a)  # in use: just loses its hash
    assert pool.lookup(1) is None and pool.blocks[a].ref_count == 1
    pool.free([b])
    pool.uncache_block(b)  # idle cached: moves to the free list
    assert pool.lookup(2) is None and list(pool._free) == [b]
    pool.free([a])
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_caching_off_never_publishes():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    assert not pool.cache_block(a, 9)
    assert pool.lookup(9) is None
    pool.free([a])
    assert list(pool._free) == [1, 0]
    pool.check_integrity()


def test_double_free_crashes():
    pool = BlockPool(2)
    [a] = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([a])


def test_check_integrity_catches_corruption():
    pool = BlockPool(3)
    [a] = pool.allocate(1)
    pool.blocks[a].ref_count = 0  # leaked: neither free, cached nor in use
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool = BlockPool(3)
    pool.blocks[0].ref_count = 1  # referenced while still on the free list
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool = BlockPool(3)
    [a] = pool.allocate(1)
    pool.cache_block(a, 4)
    pool._hash_to_block[5] = a  # map entry that the block doesn't carry
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_block_pool_has_no_torch_dependency():
    import subprocess
    import sys

    code = "import sys, common.kv_cache.block_pool, common.kv_cache.kv_cache_manager; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=_repo_root())


def _repo_root() -> str:
    from pathlib import Path

    return str(Path(__file__).resolve().parents[2])
