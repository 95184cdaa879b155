"""Which local blocks to ship after a computed span, and where they land on decode.

    prompt positions   0        16       32       48       64   70
    local blocks       | L0     | L1     | L2     | L3     | L4 |
    num_skip = 16      (decode already has block 0)
    dest_block_ids              | d0     | d1     | d2     | d3 |      d_i <- L_(i + skip/bs)

    span [0, 40)  -> ship L1, L2 (L2 holds 32..39 only: sent again later)
    span [40, 70) -> ship L2, L3, L4

A block is shipped from the span that completes (or touches) it; a block a chunk boundary cuts
is shipped again when the next span completes it (KVChunk allows re-sending). Positions decode
already holds (< num_skip) are never shipped, even if prefill computed them. A span that only
recomputes shipped positions (after a preemption) ships nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockBatch:
    local_block_ids: list[int]
    dest_block_ids: list[int]


@dataclass(slots=True)
class ShipCursor:
    """Engine-thread state of one request: how far its KV has been shipped."""

    block_size: int
    num_skip_tokens: int
    dest_block_ids: tuple[int, ...]
    shipped_until: int = -1
    """Prompt positions [0, shipped_until) are shipped (or skipped); -1 = not started."""

    def __post_init__(self) -> None:
        self.shipped_until = self.num_skip_tokens

    def advance(self, span_end: int, block_table: list[int]) -> BlockBatch | None:
        """Positions [0, span_end) now have KV (prefix-cache hits included): the blocks to send."""
        if span_end <= self.shipped_until:
            return None
        bs = self.block_size
        first = self.shipped_until // bs  # re-sends the block a previous span left partial
        last = -(-span_end // bs)
        skip_blocks = self.num_skip_tokens // bs
        self.shipped_until = span_end
        return BlockBatch(
            local_block_ids=block_table[first:last],
            dest_block_ids=[self.dest_block_ids[j - skip_blocks] for j in range(first, last)],
        )
