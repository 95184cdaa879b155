"""PagedKVCache: layout, sizing arithmetic, and the whole-block read/write round trip."""

from __future__ import annotations

import pytest
import torch

from common.attention.reference import write_kv_reference
from common.kv_cache.paged_cache import (
    PagedKVCache,
    bytes_per_block,
    num_blocks_for_memory,
    num_blocks_for_memory_fraction,
)

L, NB, BS, H, D = 3, 6, 4, 2, 8


def test_layout_and_views_share_storage():
    cache = PagedKVCache(L, NB, BS, H, D, dtype=torch.float32)
    assert len(cache.kv_caches) == L
    for k, v in cache.kv_caches:
        assert k.shape == v.shape == (NB, BS, H, D)
        assert k.is_contiguous() and v.is_contiguous()
    # What the model writes through kv_caches is what read_blocks sees.
    k1, v1 = cache.kv_caches[1]
    key = torch.randn(2, H, D)
    value = torch.randn(2, H, D)
    write_kv_reference(key, value, k1, v1, torch.tensor([4 * BS + 1, 2 * BS + 3]))
    out = cache.read_blocks([4, 2])  # [L, 2, n, BS, H, D]
    assert out.shape == (L, 2, 2, BS, H, D)
    assert torch.equal(out[1, 0, 0, 1], key[0]) and torch.equal(out[1, 1, 1, 3], value[1])
    assert out[0].abs().sum() == 0 and out[2].abs().sum() == 0


def test_read_write_round_trip():
    torch.manual_seed(0)
    cache = PagedKVCache(L, NB, BS, H, D, dtype=torch.bfloat16)
    data = torch.randn(L, 2, 3, BS, H, D).to(torch.bfloat16)
    cache.write_blocks([5, 0, 3], data)
    assert torch.equal(cache.read_blocks([5, 0, 3]), data)
    assert torch.equal(cache.read_blocks(torch.tensor([3])), data[:, :, 2:3])
    untouched = cache.read_blocks([1, 2, 4])
    assert untouched.abs().sum() == 0
    # A copy, not a view: editing the result leaves the cache alone.
    got = cache.read_blocks([0])
    got.fill_(7)
    assert torch.equal(cache.read_blocks([0]), data[:, :, 1:2])
    # Shipping blocks between two caches (e.g. prefill -> decode) with different block ids.
    other = PagedKVCache(L, NB, BS, H, D, dtype=torch.bfloat16)
    other.write_blocks([1, 2, 4], cache.read_blocks([5, 0, 3]))
    assert torch.equal(other.read_blocks([1, 2, 4]), data)
    assert cache.read_blocks([]).shape == (L, 2, 0, BS, H, D)


def test_write_blocks_validates():
    cache = PagedKVCache(L, NB, BS, H, D)
    with pytest.raises(ValueError, match="shape"):
        cache.write_blocks([0], torch.zeros(L, 2, 2, BS, H, D))
    with pytest.raises(ValueError, match="duplicate"):
        cache.write_blocks([1, 1], torch.zeros(L, 2, 2, BS, H, D))
    with pytest.raises(IndexError):
        cache.read_blocks([NB])
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCache(L, 0, BS, H, D)


def test_sizing():
    per_block = bytes_per_block(num_layers=L, num_kv_heads=H, head_dim=D, block_size=BS, dtype=torch.float16)
    assert per_block == 2 * L * BS * H * D * 2
    assert PagedKVCache.bytes_per_block(L, H, D, BS, torch.float32) == 2 * per_block
    assert num_blocks_for_memory(10 * per_block + per_block - 1, L, H, D, BS, torch.float16) == 10
    assert num_blocks_for_memory(0, L, H, D, BS, torch.float16) == 0
    cache = PagedKVCache(L, NB, BS, H, D, dtype=torch.float16)
    assert cache.storage.numel() * cache.storage.element_size() == NB * per_block


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_memory_fraction_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        num_blocks_for_memory_fraction(0.9, L, H, D, BS, torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_fraction_on_cuda():
    free, total = torch.cuda.mem_get_info()
    n = num_blocks_for_memory_fraction(0.5, L, H, D, BS, torch.float16)
    assert 0 <= n <= free // bytes_per_block(L, H, D, BS, torch.float16)
    cache = PagedKVCache(L, NB, BS, H, D, dtype=torch.float16, device="cuda")
    data = torch.randn(L, 2, 2, BS, H, D, dtype=torch.float16, device="cuda")
    cache.write_blocks([3, 1], data)
    assert torch.equal(cache.read_blocks([3, 1]), data)
