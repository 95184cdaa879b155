"""KVCacheManager: prefix hits, fork, truncate, abort, and a random stress test with a fake KV store."""

from __future__ import annotations

import random

import pytest

from common.kv_cache.kv_cache_manager import KVCacheManager
from common.kv_cache.prefix_hash import compute_block_hashes

BS = 4


def _prefill(kv: KVCacheManager, req: str, tokens: list[int]) -> int:
    """Admit and fully compute a prompt, the way the scheduler would."""
    cached = kv.get_computed_prefix(req, tokens)
    assert kv.allocate_slots(req, len(tokens))
    kv.cache_full_blocks(req, tokens, len(tokens))
    return cached


def _refs(kv: KVCacheManager, req: str) -> list[int]:
    return [kv.pool.blocks[b].ref_count for b in kv.block_table(req)]


def test_second_request_hits_shared_prefix():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = list(range(10))
    assert _prefill(kv, "a", a) == 0
    assert kv.block_table("a") == [0, 1, 2]
    b = list(range(8)) + [100, 101, 102]
    assert kv.get_computed_prefix("b", b) == 8
    assert kv.block_table("b") == [0, 1]
    assert kv.allocate_slots("b", len(b))
    assert kv.block_table("b") == [0, 1, 3]
    assert _refs(kv, "b") == [2, 2, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert kv.prefix_cache_hit_rate == 8 / 21
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 10 and kv.usage == 0.0
    kv.check_integrity()


def test_hit_never_covers_whole_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    _prefill(kv, "a", list(range(12)))  # three full blocks published
    assert kv.get_num_cached_prefix_blocks(list(range(12))) == 3  # read-only lookup sees all
    assert kv.get_computed_prefix("b", list(range(12))) == 8  # last token must be recomputed
    assert kv.get_computed_prefix("c", list(range(9))) == 8
    assert kv.get_computed_prefix("d", list(range(8))) == 4
    assert kv.get_computed_prefix("e", [0]) == 0
    assert kv.get_computed_prefix("f", []) == 0
    for r in "abcdef":
        kv.free(r)
    kv.check_integrity()


def test_hit_after_owner_finished_reuses_cached_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _prefill(kv, "a", list(range(10)))
    kv.free("a")  # blocks 0, 1 stay cached (evictable), 2 goes to the free list
    assert kv.usage == 0.0
    assert kv.get_computed_prefix("b", list(range(9))) == 8
    assert kv.block_table("b") == [0, 1]
    assert kv.num_free_blocks == 2
    kv.free("b")
    kv.check_integrity()


def test_eviction_takes_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    _prefill(kv, "a", list(range(12)))  # blocks 0, 1, 2 published
    kv.free("a")  # tail first into the LRU: 2, 1, 0
    assert kv.allocate_slots("x", 8)  # block 3 (free list), then evicts block 2
    assert kv.block_table("x") == [3, 2]
    assert kv.num_evictions == 1
    assert kv.get_num_cached_prefix_blocks(list(range(12))) == 2  # the prefix survived
    kv.free("x")
    kv.check_integrity()


def test_caching_off():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_prefix_caching=False)
    _prefill(kv, "a", list(range(10)))
    assert kv.get_computed_prefix("b", list(range(10))) == 0
    assert kv.get_num_cached_prefix_blocks(list(range(10))) == 0
    assert kv.pool.num_cached_blocks == 0
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_allocate_slots_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    assert kv.allocate_slots("a", 5)  # 2 blocks
    assert not kv.allocate_slots("b", 9)  # needs 3, only 1 left
    assert not kv.has_request("b") and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 8)  # still 2 blocks: nothing to do
    assert kv.allocate_slots("a", 9) and kv.block_table("a") == [0, 1, 2]
    assert kv.num_blocks_needed(9) == 3 and kv.num_blocks_needed(0) == 0
    assert kv.usage == 1.0
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


def test_cache_full_blocks_only_computed_and_idempotent():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(10))
    kv.get_computed_prefix("a", tokens)
    kv.allocate_slots("a", 10)
    kv.cache_full_blocks("a", tokens, 6)  # chunked prefill: only block 0 is full and computed
    assert kv.pool.num_cached_blocks == 1
    kv.cache_full_blocks("a", tokens, 6)
    kv.cache_full_blocks("a", tokens, 10)
    hashes = compute_block_hashes(tokens, BS)
    assert [kv.pool.lookup(h) for h in hashes] == [0, 1]
    kv.free("a")
    kv.check_integrity()


def test_duplicate_content_keeps_first_block():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(9))
    # Both admitted before either published: no hit, both compute the same blocks.
    kv.get_computed_prefix("a", tokens)
    kv.get_computed_prefix("b", tokens)
    kv.allocate_slots("a", 9)
    kv.allocate_slots("b", 9)
    kv.cache_full_blocks("a", tokens, 9)
    kv.cache_full_blocks("b", tokens, 9)
    assert kv.block_table("b") == [3, 4, 5]
    assert [kv.pool.lookup(h) for h in compute_block_hashes(tokens, BS)] == [0, 1]
    kv.free("b")  # b's blocks were private: straight to the free list
    assert kv.pool.num_cached_blocks == 2
    kv.free("a")
    kv.check_integrity()


def test_fork_shares_full_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    _prefill(kv, "p", list(range(10)))
    assert kv.fork("p", "c", 10) == 8
    assert kv.block_table("c") == [0, 1]
    assert _refs(kv, "p") == [2, 2, 1]
    kv.check_integrity()
    assert kv.allocate_slots("c", 11)  # recomputes tokens 8..10 into its own block
    assert kv.block_table("c") == [0, 1, 3]
    assert kv.fork("p", "c2", 3) == 0 and kv.block_table("c2") == []
    kv.free("p")  # children keep the shared blocks alive
    assert kv.pool.blocks[0].ref_count == 1
    kv.check_integrity()
    kv.free("c")
    kv.free("c2")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_truncate_releases_tail_and_withdraws_partial_published_block():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    tokens = list(range(12))
    _prefill(kv, "a", tokens)  # blocks 0, 1, 2 published
    hashes = compute_block_hashes(tokens, BS)
    assert kv.truncate("a", 9) == 9  # block 2 is kept but will be rewritten from offset 1
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.pool.lookup(hashes[2]) is None  # no stale content under its hash
    assert kv.pool.lookup(hashes[1]) == 1
    kv.check_integrity()
    # New tokens replace the rejected ones; the block is published again under the new hash.
    new_tokens = tokens[:9] + [50, 51, 52]
    kv.cache_full_blocks("a", new_tokens, 12)
    assert kv.pool.lookup(compute_block_hashes(new_tokens, BS)[2]) == 2
    kv.check_integrity()

    assert kv.truncate("a", 4) == 4  # exact boundary: blocks 2, 1 released, block 0 untouched
    assert kv.block_table("a") == [0]
    assert kv.pool.lookup(hashes[0]) == 0
    # Released published blocks are correct for their hashes, so they stay cached.
    assert kv.get_num_cached_prefix_blocks(new_tokens) == 3
    assert kv.truncate("a", 0) == 0 and kv.block_table("a") == []
    assert kv.truncate("a", 7) == 0  # nothing to roll back to
    kv.free("a")
    kv.check_integrity()


def test_truncate_into_shared_block_drops_it():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))
    _prefill(kv, "a", tokens)
    assert kv.get_computed_prefix("b", tokens) == 8  # b reads blocks 0, 1
    assert kv.truncate("a", 6) == 4  # block 1 is shared: a must not rewrite it
    assert kv.block_table("a") == [0]
    assert kv.block_table("b") == [0, 1]
    assert kv.pool.lookup(compute_block_hashes(tokens, BS)[1]) == 1  # b's view stays valid
    kv.check_integrity()
    assert kv.allocate_slots("a", 6) and kv.block_table("a") == [0, 3]
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


def test_fork_then_parent_truncates_into_shared_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("p", 8)  # not published: sharing alone must make it read-only
    assert kv.fork("p", "c", 8) == 8
    assert kv.truncate("p", 5) == 4
    assert kv.block_table("p") == [0] and kv.block_table("c") == [0, 1]
    kv.free("c")
    kv.free("p")
    kv.check_integrity()


def test_free_after_abort_at_any_point():
    tokens = list(range(14))
    stages = ["admit", "prefix", "allocate", "chunk", "cache", "decode", "truncate", "fork"]
    for stop in range(len(stages) + 1):
        kv = KVCacheManager(num_blocks=10, block_size=BS)
        _prefill(kv, "warm", tokens[:9])  # a cached prefix to hit
        kv.free("warm")
        done = stages[:stop]
        if "prefix" in done:
            kv.get_computed_prefix("r", tokens)
        if "allocate" in done:
            kv.allocate_slots("r", 8)
        if "chunk" in done:
            kv.cache_full_blocks("r", tokens, 8)
        if "cache" in done:
            kv.allocate_slots("r", 14)
            kv.cache_full_blocks("r", tokens, 14)
        if "decode" in done:
            kv.allocate_slots("r", 17)
        if "truncate" in done:
            kv.truncate("r", 13)
        if "fork" in done:
            kv.fork("r", "r2", 13)
        kv.check_integrity()
        kv.free("r")
        kv.free("r")  # a second abort is harmless
        kv.free("r2")
        kv.free("never-seen")
        kv.check_integrity()
        assert kv.num_free_blocks == 10 and kv.usage == 0.0, stages[:stop]


def test_get_computed_prefix_on_non_empty_table_crashes():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.allocate_slots("a", 4)
    with pytest.raises(AssertionError):
        kv.get_computed_prefix("a", list(range(8)))


# ---- random stress test with a fake KV store -------------------------------------------------
class _Sim:
    """Drives the manager like a scheduler and model would, writing fake KV into a slot store.

    A slot's "KV" is the tuple of tokens up to and including its position, which is what real K/V
    depends on. Every request must always read exactly its own prefix through its table, and
    nobody may write into a block that is shared or published.
    """

    def __init__(self, rng: random.Random, num_blocks: int) -> None:
        self.rng = rng
        self.kv = KVCacheManager(num_blocks=num_blocks, block_size=BS)
        self.store: dict[tuple[int, int], tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.next_id = 0
        self.bases = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]

    def _slot(self, req: str, pos: int) -> tuple[int, int]:
        table = self.kv.block_table(req)
        return table[pos // BS], pos % BS

    def _write(self, req: str, start: int, end: int) -> None:
        toks = self.tokens[req]
        for pos in range(start, end):
            block, off = self._slot(req, pos)
            meta = self.kv.pool.blocks[block]
            assert meta.ref_count == 1, f"write into shared block {block}"
            assert meta.block_hash is None, f"write into published block {block}"
            self.store[block, off] = tuple(toks[: pos + 1])

    def verify(self, req: str) -> None:
        toks = self.tokens[req]
        for pos in range(self.computed[req]):
            assert self.store.get(self._slot(req, pos)) == tuple(toks[: pos + 1]), (req, pos)

    def admit(self) -> None:
        req = f"r{self.next_id}"
        self.next_id += 1
        base = self.rng.choice(self.bases)
        suffix = [self.rng.randrange(5) for _ in range(self.rng.randrange(1, 8))]
        prompt = base[: self.rng.randrange(len(base) + 1)] + suffix
        cached = self.kv.get_computed_prefix(req, prompt)
        assert cached % BS == 0 and cached < len(prompt)
        self.tokens[req], self.computed[req] = prompt, cached
        self.verify(req)  # a prefix hit must hold exactly this prompt's KV

    def step(self, req: str) -> None:
        toks, done = self.tokens[req], self.computed[req]
        if done == len(toks):  # decode: sample 1 token, maybe draft a few more
            toks.extend(self.rng.randrange(5) for _ in range(self.rng.choice([1, 1, 3])))
        end = min(len(toks), done + self.rng.randrange(1, 9))
        if not self.kv.allocate_slots(req, end):
            self.drop(req)  # preempted: the scheduler frees and would recompute later
            return
        self._write(req, done, end)
        self.computed[req] = end
        self.kv.cache_full_blocks(req, toks, end)

    def rollback(self, req: str) -> None:
        n = self.rng.randrange(self.computed[req] + 1)
        kept = self.kv.truncate(req, n)
        assert kept <= n and n - kept < BS
        del self.tokens[req][n:]
        self.computed[req] = kept

    def fork(self, parent: str) -> None:
        child = f"r{self.next_id}"
        self.next_id += 1
        num = self.computed[parent]
        shared = self.kv.fork(parent, child, num)
        assert shared % BS == 0 and num - shared < BS
        self.tokens[child], self.computed[child] = list(self.tokens[parent][:num]), shared

    def drop(self, req: str) -> None:
        self.kv.free(req)
        del self.tokens[req], self.computed[req]


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_integrity(seed: int):
    rng = random.Random(seed)
    sim = _Sim(rng, num_blocks=24)
    for _ in range(1500):
        live = list(sim.tokens)
        op = rng.random()
        if not live or op < 0.15:
            sim.admit()
        elif op < 0.65:
            sim.step(rng.choice(live))
        elif op < 0.75:
            sim.rollback(rng.choice(live))
        elif op < 0.82:
            sim.fork(rng.choice(live))
        else:
            sim.drop(rng.choice(live))
        sim.kv.check_integrity()
        for req in sim.tokens:
            sim.verify(req)
    assert sim.kv.prefix_cache_hits > 0 and sim.kv.num_evictions > 0  # the test exercised both
    for req in list(sim.tokens):
        sim.drop(req)
    sim.kv.check_integrity()
    assert sim.kv.num_free_blocks == sim.kv.num_blocks and sim.kv.usage == 0.0
