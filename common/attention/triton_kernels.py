"""Triton paged attention for CUDA: `write_kv` and `paged_attention`, same contract as reference.py.

Cache layout per layer: key_cache / value_cache are [num_blocks, block_size, num_kv_heads, head_dim].

write_kv: one program per new token; it copies all kv heads of that token to
    slot = slot_mapping[t]  ->  cache[slot // block_size, slot % block_size, :, :]
and skips the token when slot == -1.

paged_attention: one kernel for decode, chunked prefill and multi-token verification.
Grid = (query tiles, kv heads). A query tile is BLOCK_Q consecutive query tokens of ONE sequence times
the G = num_heads // num_kv_heads query heads that share a kv head, flattened into BLOCK_M rows,
so the K/V tile loaded for a kv head serves every query head of its group (GQA; MHA is G = 1):

    row r of the tile:  token  j = tile_first + r // G      (local index inside the sequence)
                        head   h = kv_head * G + r % G
                        rows r >= BLOCK_Q * G are padding (BLOCK_Q = BLOCK_M // G)

Tiles are numbered over the flat batch without a host sync: sequence b owns the tile ids
    tile_start(b) = query_start_loc[b] // BLOCK_Q + b  ...  tile_start(b + 1) - 1
(always >= cdiv(query_len_b, BLOCK_Q) ids), so the grid is T // BLOCK_Q + num_seqs programs and each
program finds its sequence by binary search; surplus programs exit at once.

Keys, for the tile of sequence b (prefix = seq_len - query_len cached tokens before this step):

    key pos:  0 ................ prefix+tile_first ......... prefix+tile_last ... seq_len
              |<-- loop 1: no mask -->|<-- loop 2: causal mask k <= q_pos -->|
              (every row sees these)   (q_pos = prefix + j)                   (never read)

    a key at position p lives at  block_tables[b, p // block_size] * block_size + p % block_size,
    gathered per key, so any block_size and any (shuffled) block table work.

Each key tile of BLOCK_N positions does S = Q K^T (fp32 accumulate), then an online softmax update
(running max m, running sum l, rescaled accumulator), in base 2 with log2(e) folded into the scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from common.attention.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,
    slot_mapping_ptr,  # [T] int64
    block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr,  # per model: constexpr so masks fold and stores vectorise
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # padding token: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# tl.max / tl.sum are spelled as tl.reduce over triton.language.standard's combine functions (exactly
# what tl.max / tl.sum do for fp32 inputs). Reason: tl.max / tl.sum are themselves @jit functions,
# and the interpreter can call them only if triton was first imported with TRITON_INTERPRET=1, while
# it recognises these combine functions and reduces with numpy. So this module interprets correctly
# whichever module imported triton first (see tests/kernels/conftest.py). Names as of triton 3.7.
@triton.jit
def _attend_tile(
    q, m_i, l_i, acc,  # running state: q [BLOCK_M, D_PAD], m/l [BLOCK_M], acc [BLOCK_M, D_PAD] fp32
    q_pos,  # [BLOCK_M] int32 position of each row's query token
    start, kv_end,  # key positions [start, start + BLOCK_N) of this tile; keys >= kv_end are not read
    key_cache_ptr, value_cache_ptr, table_row_ptr,
    block_size, kv_head, qk_scale,
    stride_cb, stride_cs, stride_ch, stride_cd,
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr,
    LOW_PRECISION_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    k_pos = start + tl.arange(0, BLOCK_N)
    k_valid = k_pos < kv_end
    # Gather one physical block id per key position (cheap: the table row stays in L1).
    block_ids = tl.load(table_row_ptr + k_pos // block_size, mask=k_valid, other=0).to(tl.int64)
    kv_off = block_ids * stride_cb + (k_pos % block_size) * stride_cs + kv_head * stride_ch
    dims = tl.arange(0, D_PAD)
    d_valid = dims < HEAD_DIM
    # K^T tile [D_PAD, BLOCK_N] and V tile [BLOCK_N, D_PAD].
    k = tl.load(
        key_cache_ptr + kv_off[None, :] + dims[:, None] * stride_cd,
        mask=d_valid[:, None] & k_valid[None, :],
        other=0.0,
    )
    v = tl.load(
        value_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd,
        mask=k_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if not LOW_PRECISION_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    if CAUSAL:
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # row fully masked so far: avoid inf - inf
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs"])  # batch size varies per step: no "== 1" recompile
def _paged_attention_kernel(
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [num_blocks, block_size, KVH, D]
    value_cache_ptr,
    out_ptr,  # [T, H, D]
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    num_seqs,
    num_heads,
    block_size,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    HEAD_DIM: tl.constexpr,  # per model; constexpr so the d-mask folds away and loads vectorise
    G: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # rows per tile = BLOCK_Q tokens * G heads (+ padding)
    BLOCK_N: tl.constexpr,  # keys per tile
    D_PAD: tl.constexpr,  # head_dim rounded up to a power of two >= 16
    LOW_PRECISION_DOT: tl.constexpr,  # feed tl.dot the 16-bit cache dtype (fp32 accumulate)
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Binary search: the last sequence b with tile_start(b) <= tile_id.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_first = (tile_id - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if tile_first >= q_len:  # surplus program
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tile_first + rows // G
    head = kv_head * G + rows % G
    row_valid = (rows < BLOCK_Q * G) & (tok < q_len)
    q_pos = prefix + tok
    dims = tl.arange(0, D_PAD)
    d_valid = dims < HEAD_DIM
    io_mask = row_valid[:, None] & d_valid[None, :]

    tok_idx = (q_start + tok).to(tl.int64)
    q = tl.load(
        query_ptr + tok_idx[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=io_mask,
        other=0.0,
    )
    if LOW_PRECISION_DOT:
        q = q.to(key_cache_ptr.dtype.element_ty)
    else:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_PAD], 0.0, tl.float32)
    table_row_ptr = block_tables_ptr + seq * stride_bt

    # Loop 1: keys every row of the tile sees (before the tile's first query position).
    kv_end = prefix + tl.minimum(tile_first + BLOCK_Q, q_len)
    unmasked_end = ((prefix + tile_first) // BLOCK_N) * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, start, kv_end,
            key_cache_ptr, value_cache_ptr, table_row_ptr,
            block_size, kv_head, qk_scale,
            stride_cb, stride_cs, stride_ch, stride_cd,
            HEAD_DIM, False, BLOCK_N, D_PAD, LOW_PRECISION_DOT, DOT_PRECISION,
        )
    # Loop 2: the diagonal tiles, with the causal mask.
    for start in range(unmasked_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, start, kv_end,
            key_cache_ptr, value_cache_ptr, table_row_ptr,
            block_size, kv_head, qk_scale,
            stride_cb, stride_cs, stride_ch, stride_cd,
            HEAD_DIM, True, BLOCK_N, D_PAD, LOW_PRECISION_DOT, DOT_PRECISION,
        )

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tok_idx[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------- host side


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device} (same device as the other inputs)")


def _check_kernel_device(device: torch.device) -> None:
    if device.type != "cuda" and not _INTERPRETED:
        raise ValueError(
            f"Triton attention kernels need CUDA tensors, got {device}; use the torch backend on CPU "
            "(or import this module with TRITON_INTERPRET=1 to run the interpreter)"
        )


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4:
        raise ValueError(
            f"key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} must match "
            f"key_cache {tuple(key_cache.shape)} {key_cache.dtype}"
        )
    if key_cache.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"cache dtype must be one of {_FLOAT_DTYPES}, got {key_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    _check_device("value_cache", value_cache, key_cache.device)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Stores each token's K/V at its cache slot (cast to the cache dtype); slot -1 is skipped."""
    _check_cache(key_cache, value_cache)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"key must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    if key.dtype not in _FLOAT_DTYPES or value.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key/value dtype must be one of {_FLOAT_DTYPES}, got {key.dtype}/{value.dtype}")
    num_tokens = key.shape[0]
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    device = key_cache.device
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        _check_device(name, t, device)
    _check_kernel_device(device)
    if num_tokens == 0:
        return
    if not slot_mapping.is_contiguous():
        slot_mapping = slot_mapping.contiguous()
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        block_size,
        *key.stride(), *value.stride(), *key_cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


def _pick_tiles(max_query_len: int, group: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100/H200-class GPU.

    Few distinct values on purpose: each combination is one compiled kernel, reused across steps.
    Decode/verification batches get small query tiles (16-32 rows: G heads x a few tokens), prefill
    batches get 64-128-row tiles so each K/V tile is reused by many queries.
    """
    rows = group * max(max_query_len, 1)
    if rows <= 16:
        block_m = 16
    elif rows <= 32:
        block_m = 32
    elif rows <= 64 or head_dim > 128:
        block_m = 64
    else:
        block_m = 128
    block_m = max(block_m, triton.next_power_of_2(group))  # at least one token per tile
    block_n = 64 if head_dim <= 128 else 32
    num_warps = 8 if block_m >= 128 or (block_m >= 64 and head_dim > 64) else 4
    num_stages = 3 if head_dim <= 128 else 2
    return block_m, block_n, num_warps, num_stages


def _check_attention_inputs(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    _check_cache(key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if query.dim() != 3 or query.shape[2] != head_dim:
        raise ValueError(f"query must be [num_tokens, num_heads, {head_dim}], got {tuple(query.shape)}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"query dtype must be one of {_FLOAT_DTYPES}, got {query.dtype}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if meta.block_size != key_cache.shape[1]:
        raise ValueError(f"meta.block_size ({meta.block_size}) != cache block_size ({key_cache.shape[1]})")
    num_seqs = meta.num_seqs
    if len(meta.query_lens_cpu) != num_seqs or sum(meta.query_lens_cpu) != query.shape[0]:
        raise ValueError(
            f"query has {query.shape[0]} tokens but meta.query_lens_cpu sums to {sum(meta.query_lens_cpu)} "
            f"over {len(meta.query_lens_cpu)} sequences (seq_lens_cpu has {num_seqs})"
        )
    for q_len, s_len in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        if q_len > s_len:
            raise ValueError(f"query_len {q_len} exceeds seq_len {s_len}")
    expected = {
        "query_start_loc": (meta.query_start_loc, torch.int32, (num_seqs + 1,)),
        "seq_lens": (meta.seq_lens, torch.int32, (num_seqs,)),
    }
    for name, (t, dtype, shape) in expected.items():
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"meta.{name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}")
    bt = meta.block_tables
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != num_seqs:
        raise ValueError(f"meta.block_tables must be int32 [{num_seqs}, max_blocks], got {bt.dtype} {tuple(bt.shape)}")
    if bt.shape[1] * meta.block_size < meta.max_seq_len:
        raise ValueError(
            f"meta.block_tables has {bt.shape[1]} columns of {meta.block_size}, too few for max_seq_len {meta.max_seq_len}"
        )
    device = query.device
    _check_device("key_cache", key_cache, device)
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        _check_device(f"meta.{name}", getattr(meta, name), device)
    _check_kernel_device(device)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], dtype of query
    """Attention of every query token over its sequence's cached keys (K/V already written)."""
    _check_attention_inputs(query, key_cache, value_cache, meta)
    group = query.shape[1] // key_cache.shape[2]
    block_m, block_n, num_warps, num_stages = _pick_tiles(meta.max_query_len, group, key_cache.shape[3])
    return _launch_paged_attention(query, key_cache, value_cache, meta, scale, block_m, block_n, num_warps, num_stages)


def _launch_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    block_m: int,
    block_n: int,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Launches the kernel with explicit tile sizes (tests use it to force small tiles)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    assert block_m >= group and block_m >= 16 and block_n >= 16, (block_m, block_n, group)
    block_q = block_m // group
    num_seqs = meta.num_seqs
    # Same dtype 16-bit inputs use bf16/fp16 MMAs; the interpreter cannot do bf16 math, so it stays fp32.
    low_precision = query.dtype == key_cache.dtype and key_cache.dtype != torch.float32 and not _INTERPRETED
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        num_seqs, num_heads, key_cache.shape[1],
        float(scale) * _LOG2E,
        *query.stride(), *out.stride(), *key_cache.stride(),
        meta.block_tables.stride(0),
        HEAD_DIM=head_dim,
        G=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        LOW_PRECISION_DOT=low_precision,
        DOT_PRECISION=None if low_precision else "ieee",  # fp32 caches: exact fp32, not tf32
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
