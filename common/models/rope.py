"""Rotary position embedding (the "rotate half" layout shared by Llama, Qwen, Mistral, Granite).

cos/sin are tabulated once in float32 for positions [0, max_position_embeddings) and gathered by
each token's position, so a flat batch of mixed positions needs no per-sequence work.

    head vector x = [x1 | x2]  (two halves of head_dim / 2)
    rotated       = [x1 * cos - x2 * sin | x2 * cos + x1 * sin]
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths (beyond the original context / low_freq_factor) are slowed by `factor`,
    # short ones (below original / high_freq_factor) are kept, and the band between is blended.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device | str) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim // 2]
        # Not persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T] int64
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Cast like HF: the tables are float32, the rotation runs in the activations' dtype.
        cos = self.cos[positions].to(query.dtype).unsqueeze(1)  # [T, 1, head_dim // 2]
        sin = self.sin[positions].to(query.dtype).unsqueeze(1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
