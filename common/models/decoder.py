"""Our PyTorch decoder for every supported architecture: flat tokens in, hidden states out.

One layer (pre-norm; Granite scales each branch by residual_multiplier):

    x = x + r * o_proj(attention(rope(qk_norm?(split(qkv_proj(norm(x)))))))
    x = x + r * down_proj(silu(gate) * up),  [gate | up] = gate_up_proj(norm(x))

q/k/v and gate/up are fused into one matmul each; the loader concatenates the HF weights.
Parameters are allocated uninitialised (`torch.empty`): a checkpoint always fills them.
With a `weight_dtype` (bfloat16 under float32 compute) the matrices (linear layers, embeddings,
LM head) are stored in it and widened where they are used; norms, biases, activations and the KV
cache keep the compute dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.attention.backend import AttentionBackend
from common.attention.metadata import AttentionMetadata
from common.kernels.cpu_decoder import CACHED_WEIGHT_BYTES, FusedDecoder
from common.kernels.small_gemm import linear
from common.models.config import ModelConfig
from common.models.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class Linear(nn.Module):
    """nn.Linear without the random init (weights come from the checkpoint)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, factory: dict[str, Any]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, factory: dict[str, Any]) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, **factory), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as HF does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, factory: dict[str, Any]) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attention_scale
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, factory)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, factory)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, factory) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, factory) if cfg.qk_norm else None
        self.rotary = rotary  # shared by all layers, not owned
        self.backend = backend

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, factory: dict[str, Any]) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, factory)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # 2 x [T, I]
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, factory: dict[str, Any]) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, factory)
        self.attn = Attention(cfg, rotary, backend, factory)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, factory)
        self.mlp = MLP(cfg, factory)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn_out = self.attn(self.input_norm(x), positions, kv_cache, meta)
        x = x + attn_out * self.residual_multiplier if self.residual_multiplier != 1.0 else x + attn_out
        mlp_out = self.mlp(self.post_attn_norm(x))
        return x + mlp_out * self.residual_multiplier if self.residual_multiplier != 1.0 else x + mlp_out


class DecoderModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        attention: AttentionBackend,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        weight_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        factory = {"dtype": dtype or cfg.dtype, "device": torch.device(device)}
        self.compute_dtype: torch.dtype = factory["dtype"]
        weights = {**factory, "dtype": weight_dtype or factory["dtype"]}  # the matrices' storage
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **weights), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary, attention, factory) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, factory)
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **weights), requires_grad=False)
        )
        if weights["dtype"] != factory["dtype"]:
            for layer in self.layers:
                for linear_layer in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                    shape = linear_layer.weight.shape  # still uninitialised: re-allocating costs nothing
                    linear_layer.weight = nn.Parameter(torch.empty(shape, **weights), requires_grad=False)
        self.use_fused_cpu = True  # small float32 CPU batches take cpu_decoder.cpp (False: PyTorch only)
        self._fused: FusedDecoder | None = None  # the native CPU path's view of weights + caches
        # What a decode step reads, the layers' matrices and the LM head, stays in cache from one
        # step to the next: the head's few-row products may then take small_gemm's register tiles
        # (where native.tiles_in_cache(), as the fused decoder's layers do: cpu_decoder.py).
        streamed_bytes = (cfg.layer_weights * cfg.num_layers + self.lm_head.numel()) * self.lm_head.element_size()
        self.weights_cached = streamed_bytes <= CACHED_WEIGHT_BYTES

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: activations, norms, biases and the KV cache."""
        return self.compute_dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """How the matrices are stored (the compute dtype, or bfloat16 under float32)."""
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.no_grad()  # not inference_mode: callers may edit the outputs in place
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, the flat tokens of every sequence in the step
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (key_cache, value_cache) per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} kv caches (one per layer), got {len(kv_caches)}")
        x = F.embedding(input_ids, self.embed_tokens).to(self.compute_dtype)  # [T, hidden]; no-op unless bf16 storage
        if self.config.embedding_multiplier != 1.0:
            x = x * self.config.embedding_multiplier
        if self.use_fused_cpu:
            fused = self._fused
            if fused is not None and fused.key == FusedDecoder.key_of(self, kv_caches):
                if FusedDecoder.takes_batch(x, meta):  # built for these weights and caches: taken
                    return fused.forward(x, positions, meta)
            elif FusedDecoder.supports(self, x, kv_caches, meta):
                self._fused = FusedDecoder(self, kv_caches)
                return self._fused.forward(x, positions, meta)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, kv_cache, meta)
        return self.norm(x)

    @torch.no_grad()  # not inference_mode: callers may edit the outputs in place
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab] float32
        logits = linear(hidden, self.lm_head, cached=self.weights_cached).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        return logits
