"""Chained hashes of full KV blocks, the keys of the prefix cache.

    tokens:  [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]      (block_size 16)
    hashes:  [    h0     |     h1     |  (partial: none) ]
    h0 = H(ROOT, t0..t15),  h1 = H(h0, t16..t31)

A block's KV depends on every token before it, so its key chains in the parent's hash: equal
hashes mean equal whole prefixes, not just equal blocks. Only full blocks get a hash.

The hash is xxh3-64 over a fixed little-endian byte encoding, so it is the same in every process
and on every machine (Python's `hash()` of str/bytes is salted per process and would not be).
64 bits fit a protobuf uint64 when services compare hashes (e.g. the router's prefix affinity).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

# Parent hash of the first block. Any fixed value works; it only has to be the same everywhere.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block: H(parent_hash, tuple(token_ids)) as an unsigned 64-bit int.

    `parent_hash` is None (or ROOT_HASH) for the first block of a sequence.
    """
    parent = ROOT_HASH if parent_hash is None else parent_hash
    # "<Q" for the parent, then one little-endian int64 per token: explicit widths and byte
    # order, so the bytes (and the hash) do not depend on the platform.
    data = struct.pack(f"<Q{len(token_ids)}q", parent, *token_ids)
    return xxhash.xxh3_64_intdigest(data)


def compute_block_hashes(
    token_ids: Sequence[int], block_size: int, parent_hash: int | None = None
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a trailing partial block gets none).

    `parent_hash` continues an existing chain (the hash of the block before token_ids[0]).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
