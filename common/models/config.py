"""`ModelConfig`: one normalised, validated view of an HF model folder's config.json.

Reads the JSON directly (no transformers import) and accepts both spellings of RoPE settings:
transformers 5.x `rope_parameters` {rope_theta, rope_type, ...} and the older top-level
`rope_theta` + `rope_scaling` {type|rope_type, factor, ...}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.models.architectures import ARCHITECTURES, ArchSpec, get_arch_spec

ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear and llama3: how far the context was stretched
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the pre-stretch context


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF class name, a key of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # == num_heads for MHA
    head_dim: int  # may differ from hidden_size // num_heads (Qwen3)
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm of q and k
    embedding_multiplier: float  # Granite; 1.0 elsewhere
    attention_scale: float  # softmax scale: Granite's attention_multiplier, else head_dim ** -0.5
    residual_multiplier: float  # Granite: scales each block's output before the residual add
    logits_scaling: float  # Granite: logits are divided by it
    eos_token_ids: list[int] = field(default_factory=list)  # config.json + generation_config.json
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.float32  # the checkpoint's dtype, used by load_model(dtype="auto")
    # Attention here is always full; full == sliding whenever seq_len <= sliding_window, so the
    # engine must keep contexts within `max_model_len` (which folds the window in).
    sliding_window: int | None = None

    @property
    def spec(self) -> ArchSpec:
        return ARCHITECTURES[self.architecture]

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_weights(self) -> int:
        """Weights of one decoder layer's linear layers (q, k, v, o, gate, up, down): what a token
        streams and multiplies per layer (norms and biases left out)."""
        return self.hidden_size * (2 * self.q_size + 2 * self.kv_size) + 3 * self.hidden_size * self.intermediate_size

    @staticmethod
    def from_pretrained(path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        generation = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return ModelConfig.from_dict(raw, generation)

    @staticmethod
    def from_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        generation = generation or {}
        archs = raw.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {archs!r}; "
                f"supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        architecture = archs[0]
        spec = get_arch_spec(architecture)

        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = _head_dim(raw, spec, hidden_size, num_heads)
        granite = spec.granite_multipliers
        attention_bias = bool(raw.get("attention_bias", False))

        cfg = ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or spec.qkv_bias_always,
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=spec.qk_norm,
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)) if granite else 1.0,
            attention_scale=float(raw.get("attention_multiplier", 1.0)) if granite else head_dim**-0.5,
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)) if granite else 1.0,
            logits_scaling=float(raw.get("logits_scaling", 1.0)) if granite else 1.0,
            eos_token_ids=_merge_ids(raw.get("eos_token_id"), generation.get("eos_token_id")),
            bos_token_id=_first_id(raw.get("bos_token_id"), generation.get("bos_token_id")),
            pad_token_id=_first_id(raw.get("pad_token_id"), generation.get("pad_token_id")),
            dtype=_dtype(raw),
            sliding_window=_sliding_window(raw, spec),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.logits_scaling == 0:
            raise ValueError("logits_scaling must be non-zero")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _head_dim(raw: dict[str, Any], spec: ArchSpec, hidden_size: int, num_heads: int) -> int:
    explicit = raw.get("head_dim") if spec.head_dim_from_config else None
    if explicit:
        return int(explicit)
    if spec.default_head_dim is not None:
        return spec.default_head_dim
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads})")
    return hidden_size // num_heads


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer-type rope_parameters are not supported: {params!r}")
    # Old style first, so the new `rope_parameters` wins where both are present.
    merged: dict[str, Any] = {**(raw.get("rope_scaling") or {}), **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if float(merged.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor is not supported, got {merged['partial_rotary_factor']}")
    defaults = RopeConfig()
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", defaults.factor)) if rope_type != "default" else 1.0,
        low_freq_factor=float(merged.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(merged.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _merge_ids(*values: Any) -> list[int]:
    ids: list[int] = []
    for value in values:
        ids.extend(i for i in _as_id_list(value) if i not in ids)
    return ids


def _first_id(*values: Any) -> int | None:
    for value in values:
        ids = _as_id_list(value)
        if ids:
            return ids[0]
    return None


def _dtype(raw: dict[str, Any]) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _sliding_window(raw: dict[str, Any], spec: ArchSpec) -> int | None:
    if spec.sliding_window_flag and not raw.get("use_sliding_window", False):
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None
