"""The pool of KV blocks: integer ids, ref counts, the free list and the prefix-hash map.

Every block is in exactly one of three states:

    FREE       ref 0, no hash     in `_free` (FIFO: allocate from the left, return on the right)
    CACHED     ref 0, has hash    in `_evictable` (LRU: oldest on the left is evicted first)
    IN USE     ref > 0            held by one or more block tables; may or may not have a hash

    allocate():  FREE -> IN USE, else evict CACHED (LRU) -> IN USE (its hash is dropped)
    free():      IN USE -(ref hits 0)-> CACHED if it has a hash, else FREE
    touch():     CACHED -> IN USE (a prefix hit), or IN USE ref + 1 (sharing)

Allocation prefers never-hashed blocks, so cached prefixes live as long as possible. The pool
answers "can I?" with blocks or None; who gets memory is the scheduler's business. No torch here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while the block is published in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # block ids, LRU order
        self._hash_to_block: dict[int, int] = {}
        self.num_evictions = 0

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks published in the prefix cache (in use or evictable)."""
        return len(self._hash_to_block)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    # ---- allocate / share / free --------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref 1, or None if the pool can't supply all of them (never partial)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            return None
        ids: list[int] = []
        for _ in range(n):
            if self._free:
                block_id = self._free.popleft()
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._drop_hash(self.blocks[block_id])
                self.num_evictions += 1
            self.blocks[block_id].ref_count = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hit, fork). Revives cached blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                # Only cached blocks are reachable with ref 0 (through the hash map).
                assert block.block_hash is not None, f"touch of free block {block_id}"
                del self._evictable[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order.

        Blocks reaching ref 0 join the LRU in that order, so callers pass a table tail-first:
        the tail (least likely shared by a later prompt) is then evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)

    # ---- prefix cache -------------------------------------------------------------------------
    def lookup(self, block_hash: int) -> int | None:
        """Block published under `block_hash`, if any. Read-only: takes no reference."""
        if not self.enable_caching:
            return None
        return self._hash_to_block.get(block_hash)

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Publish an in-use, full, computed block under `block_hash`.

        Returns False (and changes nothing) if caching is off or another block already holds
        that hash: the existing entry stays, this block simply stays private.
        """
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"cache_block of unreferenced block {block_id}"
        if block.block_hash is not None:
            # Re-publishing is fine; a different hash would mean its content changed in place.
            assert block.block_hash == block_hash, (
                f"block {block_id} already cached under {block.block_hash:#x}, not {block_hash:#x}"
            )
            return True
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Withdraw a block from the prefix cache (its content is about to change)."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            return
        self._drop_hash(block)
        if block.ref_count == 0:
            del self._evictable[block_id]
            self._free.append(block_id)

    def _drop_hash(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        block.block_hash = None

    # ---- invariants ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "block twice in the free list"
        assert not free & evictable, f"blocks both free and cached: {sorted(free & evictable)}"
        in_use = 0
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_count >= 0, f"block {bid} has ref count {block.ref_count}"
            if block.ref_count > 0:
                in_use += 1
                assert bid not in free, f"block {bid} is free but referenced ({block.ref_count})"
                assert bid not in evictable, f"block {bid} is evictable but referenced"
            elif block.block_hash is None:
                assert bid in free, f"unreferenced, unhashed block {bid} is not in the free list"
            else:
                assert bid in evictable, f"unreferenced cached block {bid} is not evictable"
            if block.block_hash is not None:
                assert self._hash_to_block.get(block.block_hash) == bid, (
                    f"block {bid} has hash {block.block_hash:#x} but the map disagrees"
                )
        assert len(free) + len(evictable) + in_use == self.num_blocks, (
            f"free {len(free)} + cached {len(evictable)} + in use {in_use} != {self.num_blocks}"
        )
        for block_hash, bid in self._hash_to_block.items():
            assert self.blocks[bid].block_hash == block_hash, f"hash map entry {block_hash:#x} -> {bid} is stale"
        if not self.enable_caching:
            assert not self._hash_to_block, "caching is off but the hash map is not empty"
