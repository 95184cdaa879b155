"""Builders shared by the kernel tests: a paged cache filled from contiguous per-sequence K/V."""

from __future__ import annotations

import torch

from common.attention.metadata import AttentionMetadata
from common.attention.reference import write_kv_reference


def dense_causal_attention(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [s_len, KVH, D] whole sequence, contiguous
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [q_len, H, D] float64
    q_len, num_heads, _ = q.shape
    s_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh = h // group  # GQA: query head h reads kv head h // group
        for j in range(q_len):
            pos = s_len - q_len + j
            scores = (k[: pos + 1, kh].double() @ q[j, h].double()) * scale
            weights = torch.softmax(scores, dim=0)
            out[j, h] = weights @ v[: pos + 1, kh].double()
    return out


def build_case(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Random contiguous K/V per sequence, scattered into a paged cache via shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_needed:
        tables.append(perm[i : i + n])
        i += n
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype) for s in seq_lens]
    # Whole sequences (prefix + new tokens) go in; the garbage already in the cache must never be read.
    full = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, block_size)
    write_kv_reference(torch.cat(keys), torch.cat(values), key_cache, value_cache, full.slot_mapping)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, block_size)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, meta, keys, values
