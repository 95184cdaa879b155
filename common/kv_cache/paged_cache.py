"""The torch tensors that hold K/V, addressed by the block ids of the BlockPool.

One contiguous allocation, viewed per layer:

    storage  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]     (2 = key, value)
    kv_caches[layer] = (storage[layer, 0], storage[layer, 1])   each [num_blocks, block_size, kv_heads, head_dim]

The per-layer views are contiguous (only leading dims are indexed), which is what the attention
backend expects; the single allocation lets read_blocks/write_blocks move whole blocks of every
layer with one gather/scatter, e.g. to ship a prefix between services.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_memory(
    num_bytes: int, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many whole blocks fit in num_bytes (0 if none)."""
    return max(int(num_bytes) // bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype), 0)


def num_blocks_for_memory_fraction(
    fraction: float,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str | int | None = None,
) -> int:
    """Blocks that fit if this process may use `fraction` of the GPU's total memory in all.

    Budget = fraction * total - (memory already in use on the device: weights, activations,
    other processes), as reported by torch.cuda.mem_get_info. Call after loading the model.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            "num_blocks_for_memory_fraction needs CUDA; on CPU size the cache with num_blocks_for_memory"
        )
    free, total = torch.cuda.mem_get_info(device)
    budget = int(fraction * total) - (total - free)
    return num_blocks_for_memory(max(budget, 0), num_layers, num_kv_heads, head_dim, block_size, dtype)


class PagedKVCache:
    bytes_per_block = staticmethod(bytes_per_block)
    num_blocks_for_memory = staticmethod(num_blocks_for_memory)
    num_blocks_for_memory_fraction = staticmethod(num_blocks_for_memory_fraction)

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:  # fmt: skip
            if value <= 0:
                raise ValueError(f"PagedKVCache: {name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; zeros so unwritten
        # slots never hold NaN garbage that a masked-out lane could still touch.
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=self.device
        )
        self._kv_caches = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache), each [num_blocks, block_size, kv_heads, head_dim]: the model's input."""
        return self._kv_caches

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of read_blocks' result per block: [num_layers, 2, block_size, kv_heads, head_dim] minus n."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def _index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(block_ids, dtype=torch.int64).reshape(-1)
        # Checked where the ids live (usually a host list), before moving them to the device.
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise IndexError(f"block ids out of range [0, {self.num_blocks}): {index.tolist()}")
        return index.to(self.device)

    def read_blocks(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """A copy of whole blocks for every layer: [num_layers, 2, n, block_size, kv_heads, head_dim]."""
        return self.storage.index_select(2, self._index(block_ids))

    def write_blocks(self, block_ids: Sequence[int] | torch.Tensor, data: torch.Tensor) -> None:
        """Overwrite whole blocks for every layer from data [num_layers, 2, n, block_size, kv_heads, head_dim]."""
        index = self._index(block_ids)
        L, two, bs, h, d = self.block_shape
        expected = (L, two, index.numel(), bs, h, d)
        if tuple(data.shape) != expected:
            raise ValueError(f"write_blocks: data shape {tuple(data.shape)}, expected {expected}")
        if index.unique().numel() != index.numel():
            raise ValueError(f"write_blocks: duplicate block ids {index.tolist()}")
        self.storage.index_copy_(2, index, data.to(device=self.device, dtype=self.dtype))
