"""Triton kernels (run by the Triton interpreter on CPU) against the torch reference.

`kernels` is a private copy of common/attention/triton_kernels.py loaded with TRITON_INTERPRET=1
(see conftest.py). Shapes are small because the interpreter runs every program in Python.
"""

from __future__ import annotations

import pytest
import torch

from common.attention.backend import AttentionBackend
from common.attention.metadata import AttentionMetadata
from common.attention.reference import paged_attention_reference, write_kv_reference
from tests.kernels.paged_cases import build_case, dense_causal_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def mixed_batch(block_size: int) -> tuple[list[int], list[int]]:
    """query_lens, seq_lens: every kind of query the scheduler produces, in one batch."""
    return (
        # first decode token, decode, prefill from 0, chunk after a mid-block prefix,
        # chunk after a block-aligned prefix, verification of 3 drafts, idle sequence
        [1, 1, 13, 6, 7, 4, 0],
        [1, 21, 13, 6 + 11, 7 + 2 * block_size, 30, 9],
    )


def assert_matches_reference(kernels, query, kc, vc, meta, tiles=None):
    scale = query.shape[-1] ** -0.5
    expected = paged_attention_reference(query, kc, vc, meta, scale)
    if tiles is None:
        out = kernels.paged_attention(query, kc, vc, meta, scale)
    else:
        out = kernels._launch_paged_attention(query, kc, vc, meta, scale, *tiles)
    assert out.shape == query.shape and out.dtype == query.dtype
    tol = TOLERANCE[query.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


CONFIGS = {
    # name: (num_heads, num_kv_heads, head_dim, block_size, dtype)
    "mha-fp32-d32-bs16": (4, 4, 32, 16, torch.float32),
    "gqa4-bf16-d64-bs8": (8, 2, 64, 8, torch.bfloat16),
    "gqa3-fp16-d16-bs32": (6, 2, 16, 32, torch.float16),
    "mqa-fp32-d128-bs16": (4, 1, 128, 16, torch.float32),
    "gqa2-fp32-d24-bs16": (4, 2, 24, 16, torch.float32),  # head_dim padded to 32 with masks
}


@pytest.mark.parametrize("tiles", [None, (16, 16)], ids=["auto-tiles", "16x16-tiles"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
def test_mixed_batch_matches_reference(kernels, config, tiles):
    num_heads, num_kv_heads, head_dim, block_size, dtype = CONFIGS[config]
    query_lens, seq_lens = mixed_batch(block_size)
    query, kc, vc, meta, _, _ = build_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=len(config)
    )
    assert_matches_reference(kernels, query, kc, vc, meta, tiles)


@pytest.mark.parametrize(
    "query_lens,seq_lens",
    [
        ([1, 1, 1, 1], [1, 16, 17, 40]),  # pure decode: the 16-row tile path
        ([3, 4, 2], [3 + 16, 4 + 9, 2 + 31]),  # pure verification
        ([40], [40 + 5]),  # one long chunk: several query tiles, many causal tiles
    ],
    ids=["decode", "verify", "long-chunk"],
)
def test_batch_shapes(kernels, query_lens, seq_lens):
    query, kc, vc, meta, _, _ = build_case(query_lens, seq_lens, 4, 2, 32, 16, torch.float32, seed=3)
    assert_matches_reference(kernels, query, kc, vc, meta)
    assert_matches_reference(kernels, query, kc, vc, meta, tiles=(16, 16))


def test_matches_dense_attention_directly(kernels):
    """Kernel vs dense attention on contiguous K/V (not only vs the reference)."""
    query_lens, seq_lens = mixed_batch(8)
    query, kc, vc, meta, keys, values = build_case(query_lens, seq_lens, 6, 2, 16, 8, torch.float32, seed=11)
    out = kernels._launch_paged_attention(query, kc, vc, meta, 0.3, 16, 16)
    start = 0
    for q_len, k, v in zip(query_lens, keys, values):
        if q_len:
            expected = dense_causal_attention(query[start : start + q_len], k, v, 0.3)
            torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=2e-5, rtol=2e-5)
        start += q_len


def test_strided_query_view(kernels):
    """q as a slice of a fused qkv projection (non-contiguous token stride)."""
    query_lens, seq_lens = [2, 5], [9, 5]
    query, kc, vc, meta, _, _ = build_case(query_lens, seq_lens, 4, 2, 16, 8, torch.float32, seed=5)
    fused = torch.randn(query.shape[0], 8, 16)
    fused[:, :4] = query
    view = fused[:, :4]
    assert not view.is_contiguous()
    assert_matches_reference(kernels, view, kc, vc, meta)


@pytest.mark.parametrize("src_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float16)])
def test_write_kv_places_each_token_at_its_slot(kernels, src_dtype, cache_dtype):
    num_blocks, block_size, kvh, d = 6, 8, 2, 16
    gen = torch.Generator().manual_seed(0)
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(cache_dtype)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(cache_dtype)
    # Non-contiguous key/value views, as split from a fused projection.
    fused = torch.randn(5, 3 * kvh, d, generator=gen).to(src_dtype)
    key, value = fused[:, kvh : 2 * kvh], fused[:, 2 * kvh :]
    slots = torch.tensor([5, -1, 47, 8, 0], dtype=torch.int64)  # -1: padding token, skipped
    kc_ref, vc_ref = kc.clone(), vc.clone()
    keep = slots >= 0
    write_kv_reference(key[keep], value[keep], kc_ref, vc_ref, slots[keep])
    kernels.write_kv(key, value, kc, vc, slots)
    if src_dtype == cache_dtype:
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:
        # The interpreter truncates fp32 -> bf16 (a compiled kernel rounds to nearest even, like torch),
        # so allow one bf16 ulp here.
        torch.testing.assert_close(kc, kc_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(vc, vc_ref, atol=0, rtol=2**-7)
    # Spot-check the address arithmetic directly: slot 47 = block 5, offset 7.
    torch.testing.assert_close(kc[5, 7], key[2].to(cache_dtype), atol=0, rtol=2**-7)
    torch.testing.assert_close(vc[1, 0], value[3].to(cache_dtype), atol=0, rtol=2**-7)


def test_backend_chunked_prefill_then_decode(kernels):
    """Triton write_kv + paged_attention through AttentionBackend, step by step, vs dense attention."""
    heads, kv_heads, d, block_size = 4, 2, 16, 8
    backend = AttentionBackend("triton", kernels.write_kv, kernels.paged_attention)
    gen = torch.Generator().manual_seed(1)
    total = 23
    q_all = torch.randn(total, heads, d, generator=gen)
    k_all = torch.randn(total, kv_heads, d, generator=gen)
    v_all = torch.randn(total, kv_heads, d, generator=gen)
    kc = torch.zeros(6, block_size, kv_heads, d)
    vc = torch.zeros(6, block_size, kv_heads, d)
    table = [4, 0, 5, 2]
    done = 0
    for chunk in [11, 9, 1, 1, 1]:  # chunked prefill, then three decode steps
        meta = AttentionMetadata.build([chunk], [done + chunk], [table], block_size)
        sl = slice(done, done + chunk)
        out = backend.forward(q_all[sl], k_all[sl], v_all[sl], kc, vc, meta, 0.25)
        expected = dense_causal_attention(q_all[sl], k_all[: done + chunk], v_all[: done + chunk], 0.25)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
        done += chunk


def test_pick_tiles_are_mma_friendly(kernels):
    for group in (1, 2, 3, 4, 7, 8, 16, 32):
        for max_q in (1, 2, 5, 16, 512):
            for d in (64, 128, 256):
                block_m, block_n, warps, stages = kernels._pick_tiles(max_q, group, d)
                assert block_m >= 16 and block_m >= group and block_m & (block_m - 1) == 0
                assert block_n >= 16 and block_n & (block_n - 1) == 0
                assert warps in (4, 8) and stages >= 2


# --------------------------------------------------------------------------- checking wrapper


def _small_case():
    return build_case([2, 1], [5, 9], 4, 2, 16, 8, torch.float32, seed=0)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda q, kc, vc, m: (q[:, :3], kc, vc, m), "multiple of num_kv_heads"),
        (lambda q, kc, vc, m: (q[:, :, :8], kc, vc, m), "query must be"),
        (lambda q, kc, vc, m: (q.double(), kc, vc, m), "query dtype"),
        (lambda q, kc, vc, m: (q, kc, vc.half(), m), "must match"),
        (lambda q, kc, vc, m: (q, kc.transpose(1, 2), vc.transpose(1, 2), m), "contiguous"),
        (lambda q, kc, vc, m: (q[:2], kc, vc, m), "tokens"),
    ],
    ids=["heads", "head_dim", "fp64", "value-dtype", "non-contiguous-cache", "token-count"],
)
def test_paged_attention_rejects_bad_inputs(kernels, mutate, message):
    query, kc, vc, meta, _, _ = _small_case()
    with pytest.raises(ValueError, match=message):
        kernels.paged_attention(*mutate(query, kc, vc, meta), 0.25)


def test_paged_attention_rejects_bad_metadata(kernels):
    query, kc, vc, meta, _, _ = _small_case()
    meta.block_tables = meta.block_tables.long()
    with pytest.raises(ValueError, match="block_tables must be int32"):
        kernels.paged_attention(query, kc, vc, meta, 0.25)
    _, _, _, meta, _, _ = _small_case()
    meta.block_size = 16
    with pytest.raises(ValueError, match="block_size"):
        kernels.paged_attention(query, kc, vc, meta, 0.25)


def test_write_kv_rejects_bad_inputs(kernels):
    kc = torch.zeros(2, 4, 2, 8)
    vc = torch.zeros(2, 4, 2, 8)
    key = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        kernels.write_kv(key, key, kc, vc, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="key must be"):
        kernels.write_kv(torch.zeros(3, 1, 8), torch.zeros(3, 1, 8), kc, vc, torch.zeros(3, dtype=torch.int64))


def test_compiled_module_refuses_cpu_tensors():
    """The normally imported (compiling) module must say clearly that CPU tensors need the torch path."""
    pytest.importorskip("triton")
    from common.attention import triton_kernels

    if triton_kernels._INTERPRETED:
        pytest.skip("the process runs with TRITON_INTERPRET=1")
    query, kc, vc, meta, _, _ = _small_case()
    with pytest.raises(ValueError, match="need CUDA tensors"):
        triton_kernels.paged_attention(query, kc, vc, meta, 0.25)
