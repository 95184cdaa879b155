"""Per-request block tables on top of the BlockPool: what the scheduler calls.

A request's table maps its token positions to blocks (position p lives in block
table[p // block_size] at offset p % block_size). A request's life, seen from here:

    get_computed_prefix()  attach the cached leading full blocks (maybe none)
    allocate_slots()       grow the table before each step that writes new tokens
    cache_full_blocks()    after the step: publish the blocks that became full and computed
    truncate()             roll back rejected speculative tokens
    fork()                 n > 1: a child shares the parent's full blocks
    free()                 finished, aborted or preempted (safe at any point, idempotent)

Shared blocks (ref count > 1: a prefix hit or a fork) are read-only: nobody writes into them,
because only full blocks are ever shared and requests only write past their computed tokens.
The one way to write into an old block is truncate(), which is handled there.

This module decides "can I?"; which request gets memory or is preempted is the scheduler's call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from common.kv_cache.block_pool import BlockPool
from common.kv_cache.prefix_hash import hash_block_tokens


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the leading full, computed blocks already offered to the cache (or found
    # there): cache_full_blocks() resumes the chain from here. len <= len(block_ids).
    block_hashes: list[int] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self._requests: dict[Hashable, _RequestBlocks] = {}
        self.prefix_cache_queries = 0  # prompt tokens looked up by get_computed_prefix
        self.prefix_cache_hits = 0  # of those, tokens found in the cache

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (free + evictable cached)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (cached-but-idle blocks count as free)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served from the cache (0.0 before any lookup)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def num_evictions(self) -> int:
        return self.pool.num_evictions

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a table needs to cover positions [0, num_tokens)."""
        return -(-num_tokens // self._block_size)

    def has_request(self, req_id: Hashable) -> bool:
        return req_id in self._requests

    def block_table(self, req_id: Hashable) -> list[int]:
        """A copy of the request's block ids, in position order."""
        return list(self._requests[req_id].block_ids)

    # ---- prefix cache -------------------------------------------------------------------------
    def get_computed_prefix(self, req_id: Hashable, token_ids: Sequence[int]) -> int:
        """Attach the longest cached run of leading full blocks; return the tokens they hold.

        The result is a multiple of block_size and < len(token_ids): the last prompt token is
        always recomputed, since the step needs its logits. Call on a request with an empty
        table (first admission, or after free() on preemption / failed admission).
        """
        state = self._requests.setdefault(req_id, _RequestBlocks())
        assert not state.block_ids, f"get_computed_prefix({req_id!r}) on a non-empty table; free() it first"
        if not self.enable_prefix_caching:
            return 0
        bs = self._block_size
        max_blocks = max(len(token_ids) - 1, 0) // bs
        parent: int | None = None
        for i in range(max_blocks):
            block_hash = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            state.block_ids.append(block_id)
            state.block_hashes.append(block_hash)
            parent = block_hash
        self.pool.touch(state.block_ids)
        num_cached = len(state.block_ids) * bs
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_cached
        return num_cached

    def get_num_cached_prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """How many leading full blocks of token_ids are cached now. Read-only (router affinity):
        takes no references, updates neither LRU order nor stats. May cover the whole prompt."""
        if not self.enable_prefix_caching:
            return 0
        bs = self._block_size
        parent: int | None = None
        for i in range(len(token_ids) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            if self.pool.lookup(parent) is None:
                return i
        return len(token_ids) // bs

    def cache_full_blocks(self, req_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Publish the request's blocks that are now full and computed under their chained hashes.

        `token_ids` are all the request's tokens (prompt + output) so far. Idempotent: blocks
        already offered are skipped. If another block already holds a hash, that entry wins and
        this block stays private (freed to the free list, not the cache).
        """
        if not self.enable_prefix_caching:
            return
        state = self._requests[req_id]
        bs = self._block_size
        num_full = min(min(num_computed_tokens, len(token_ids)) // bs, len(state.block_ids))
        for i in range(len(state.block_hashes), num_full):
            parent = state.block_hashes[-1] if state.block_hashes else None
            block_hash = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(state.block_ids[i], block_hash)
            state.block_hashes.append(block_hash)

    # ---- grow / shrink / share ----------------------------------------------------------------
    def allocate_slots(self, req_id: Hashable, num_total_tokens: int) -> bool:
        """Grow the table to cover positions [0, num_total_tokens). All or nothing: False (and
        no change) if the pool can't supply every block needed."""
        state = self._requests.get(req_id)
        num_new = self.num_blocks_needed(num_total_tokens) - (len(state.block_ids) if state else 0)
        new_ids = self.pool.allocate(max(num_new, 0))
        if new_ids is None:
            return False  # not even registered: a failed first allocation leaves no trace
        if state is None:
            state = self._requests[req_id] = _RequestBlocks()
        state.block_ids.extend(new_ids)
        return True

    def truncate(self, req_id: Hashable, num_tokens: int) -> int:
        """Roll back to the first num_tokens tokens: release the blocks not needed for them.

        Returns the tokens still backed by the table: normally num_tokens (capped at what the
        table covered). The caller must resume from the returned count.

        The new last block, if partial, will be overwritten past num_tokens, so it must not stay
        visible to anyone else:
          * private (ref 1) and published: withdrawn from the prefix cache (its hash names
            tokens that are about to change), then rewritten in place;
          * shared (ref > 1: a prefix hit or fork child reads it): writing would corrupt the
            other reader and we can't copy KV here, so this request drops the block and the
            result is rounded down to a block boundary; the caller recomputes those few tokens.
        Released tail blocks that were published keep their hash: their KV is exactly that of
        the (possibly rejected) tokens the hash names, so they are valid cache entries.
        """
        if num_tokens < 0:
            raise ValueError(f"truncate({req_id!r}, {num_tokens}): num_tokens must be >= 0")
        state = self._requests[req_id]
        bs = self._block_size
        num_keep = self.num_blocks_needed(num_tokens)
        if len(state.block_ids) > num_keep:
            self.pool.free(reversed(state.block_ids[num_keep:]))  # tail first, like free()
            del state.block_ids[num_keep:]
        del state.block_hashes[num_tokens // bs :]
        kept = min(num_tokens, len(state.block_ids) * bs)
        if kept % bs:
            last = state.block_ids[-1]
            if self.pool.blocks[last].ref_count > 1:
                self.pool.free([last])
                state.block_ids.pop()
                kept -= kept % bs
            else:
                self.pool.uncache_block(last)
        return kept

    def fork(self, parent_id: Hashable, child_id: Hashable, num_tokens: int) -> int:
        """The child shares the parent's full blocks covering its first num_tokens tokens (by
        ref count, no copy). Returns the tokens shared, a multiple of block_size; the child
        recomputes the rest (the partial block) into blocks of its own."""
        parent = self._requests[parent_id]
        child = self._requests.setdefault(child_id, _RequestBlocks())
        assert not child.block_ids, f"fork into {child_id!r}, which already has blocks"
        num_shared = min(num_tokens // self._block_size, len(parent.block_ids))
        child.block_ids = parent.block_ids[:num_shared]
        child.block_hashes = parent.block_hashes[:num_shared]
        self.pool.touch(child.block_ids)
        return num_shared * self._block_size

    def free(self, req_id: Hashable) -> None:
        """Release the request's blocks, tail first (so its tail is evicted before its prefix).
        Unknown ids are ignored: abort may come before any allocation, or twice."""
        state = self._requests.pop(req_id, None)
        if state is not None:
            self.pool.free(reversed(state.block_ids))

    # ---- invariants ---------------------------------------------------------------------------
    def integrity_error(self) -> str:
        """check_integrity() as a value: "" when intact, else the first violation (for GetLoad)."""
        return integrity_error(self.check_integrity)

    def check_integrity(self) -> None:
        """Pool integrity, plus: every block's ref count equals the number of tables holding it
        (so a block sits in two tables only when its ref count says it is shared)."""
        self.pool.check_integrity()
        holders: Counter[int] = Counter()
        for req_id, state in self._requests.items():
            assert len(set(state.block_ids)) == len(state.block_ids), f"{req_id!r} holds a block twice"
            assert len(state.block_hashes) <= len(state.block_ids), f"{req_id!r} has hashes past its table"
            for block_id, block_hash in zip(state.block_ids, state.block_hashes):
                cached = self.pool.blocks[block_id].block_hash
                assert cached is None or cached == block_hash, (
                    f"{req_id!r}: block {block_id} cached under {cached:#x}, table chain says {block_hash:#x}"
                )
            holders.update(state.block_ids)
        for block in self.pool.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref count {block.ref_count} but in {holders[block.block_id]} tables"
            )


def integrity_error(check: Callable[[], None]) -> str:
    """Runs an integrity check; "" when it passes, else its AssertionError's message."""
    try:
        check()
    except AssertionError as e:
        return str(e) or "integrity check failed"
    return ""
