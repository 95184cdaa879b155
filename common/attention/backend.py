"""Picks the attention implementation: Triton on CUDA, PyTorch elsewhere; either can be forced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from common.attention.metadata import AttentionMetadata
from common.attention.reference import paged_attention_reference, write_kv_reference

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        if self.name == "torch":
            return paged_attention_reference(query, key_cache, value_cache, meta, scale, key, value)
        return self.paged_attention(query, key_cache, value_cache, meta, scale)


def get_attention_backend(name: str = "auto", device: torch.device | str = "cpu") -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return AttentionBackend("torch", write_kv_reference, paged_attention_reference)
    from common.attention import triton_kernels  # imported lazily: triton is optional on CPU

    return AttentionBackend("triton", triton_kernels.write_kv, triton_kernels.paged_attention)
