"""PyTorch paged attention: the CPU path and the reference the Triton kernels are tested against.

Cache layout, per layer: key_cache / value_cache are [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from common.attention.metadata import AttentionMetadata


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    # [num_seqs, num_blocks_used, block_size, kv_heads, d] -> [num_seqs, length, kv_heads, d]
    num_seqs = block_tables.shape[0]
    num_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    # index_select over whole blocks as rows: a row-wise memcpy, many times faster on CPU than
    # advanced indexing of the 4-D cache.
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    rows = cache.view(cache.shape[0], -1).index_select(0, ids)
    return rows.view(num_seqs, num_blocks * cache.shape[1], cache.shape[2], cache.shape[3])[:, :length]


# Decode sequences are batched in groups of similar context length: padding every sequence to the
# longest context of the batch would read (and gather) far more KV than needed, e.g. 16 short
# requests next to one 4,000-token one. A group grows while its padded size stays within
# PAD_SLACK of its real size, and up to DECODE_GROUP_SIZE sequences.
DECODE_GROUP_SIZE = 32
PAD_SLACK = 1.5


def _decode_groups(seq_lens: list[int], decode_idx: list[int]) -> list[list[int]]:
    groups: list[list[int]] = []
    total = 0
    for i in sorted(decode_idx, key=lambda i: seq_lens[i]):
        n = seq_lens[i]
        g = groups[-1] if groups else None
        if g is not None and len(g) < DECODE_GROUP_SIZE and n * (len(g) + 1) <= PAD_SLACK * (total + n):
            g.append(i)
            total += n
        else:
            groups.append([i])
            total = n
    return groups


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim]: this step's K/V, if known
    value: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of every query token over its sequence's cached keys (K/V already written).

    When this step's key/value are given, a sequence with no cached prefix attends to them
    directly instead of reading them back from the cache (same numbers, no gather).
    """
    out = torch.empty_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    compute_dtype = torch.float32 if query.dtype != torch.float64 else torch.float64
    starts = meta.query_start_loc.tolist()

    decode_idx = [i for i, q in enumerate(meta.query_lens_cpu) if q == 1]
    for group in _decode_groups(meta.seq_lens_cpu, decode_idx):
        idx = torch.tensor(group, dtype=torch.long, device=query.device)
        token_idx = torch.tensor([starts[i] for i in group], dtype=torch.long, device=query.device)
        max_len = meta.seq_lens_cpu[group[-1]]
        tables = meta.block_tables[idx]
        k = _gather_context(key_cache, tables, max_len).to(compute_dtype).transpose(1, 2)
        v = _gather_context(value_cache, tables, max_len).to(compute_dtype).transpose(1, 2)
        q = query[token_idx].to(compute_dtype).unsqueeze(2)  # [B, heads, 1, d]
        mask = torch.arange(max_len, device=query.device)[None, :] < meta.seq_lens[idx][:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=gqa)
        out[token_idx] = o.squeeze(2).to(out.dtype)

    for i, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 1 or q_len == 0:
            continue
        start = starts[i]
        q = query[start : start + q_len].to(compute_dtype).transpose(0, 1).unsqueeze(0)
        if key is not None and value is not None and q_len == s_len:
            k = key[start : start + q_len].to(compute_dtype).transpose(0, 1).unsqueeze(0)
            v = value[start : start + q_len].to(compute_dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            table = meta.block_tables[i : i + 1]
            k = _gather_context(key_cache, table, s_len).to(compute_dtype).transpose(1, 2)
            v = _gather_context(value_cache, table, s_len).to(compute_dtype).transpose(1, 2)
            # Query j is at position s_len - q_len + j and sees keys up to and including it.
            q_pos = torch.arange(s_len - q_len, s_len, device=query.device)
            mask = torch.arange(s_len, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o.squeeze(0).transpose(0, 1).to(out.dtype)
    return out
