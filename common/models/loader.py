"""`load_model`: an HF folder (config.json + safetensors, single or sharded) into our decoder.

HF tensor names map onto our modules; fused projections receive each HF tensor in a row range:

    qkv_proj rows:     [ q_proj: q_size | k_proj: kv_size | v_proj: kv_size ]
    gate_up_proj rows: [ gate_proj: intermediate | up_proj: intermediate ]
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from common.attention.backend import AttentionBackend, get_attention_backend
from common.models.config import ModelConfig
from common.models.decoder import DecoderModel

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some exporters write that we recompute from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of float32/bfloat16/float16, got {dtype}")
        return dtype
    if dtype == "auto":
        return cfg.dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPE_NAMES)}, got {dtype!r}")
    return _DTYPE_NAMES[dtype]


def resolve_weight_dtype(weight_dtype: str | torch.dtype | None, compute: torch.dtype) -> torch.dtype | None:
    """None (the matrices in the compute dtype) or bfloat16: bf16 storage under float32 math."""
    if weight_dtype in (None, "auto", compute):
        return None
    if weight_dtype in ("bfloat16", torch.bfloat16):
        if compute == torch.bfloat16:
            return None  # a bf16 model: its matrices are bf16 already
        if compute != torch.float32:
            raise ValueError(f"weight_dtype bfloat16 needs float32 compute (dtype), got {compute}")
        return torch.bfloat16
    raise ValueError(f"weight_dtype must be auto or bfloat16, got {weight_dtype!r}")


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    attention: AttentionBackend | None = None,
    weight_dtype: str | torch.dtype | None = "auto",
) -> tuple[DecoderModel, ModelConfig]:
    """weight_dtype "bfloat16" (with float32 `dtype`) stores the matrices in bf16, rounded to
    nearest-even from the checkpoint, and computes in float32 (DecoderModel)."""
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    device = torch.device(device)
    backend = attention if attention is not None else get_attention_backend("auto", device)
    compute = resolve_dtype(dtype, cfg)
    model = DecoderModel(cfg, backend, dtype=compute, device=device, weight_dtype=resolve_weight_dtype(weight_dtype, compute))
    load_weights(model, _safetensors_files(path))
    model.eval()
    return model, cfg


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def expected_weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The HF tensors (name -> shape) a checkpoint of this config must hold, in a fixed order."""
    hidden, inter, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, hidden)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, hidden)
            if cfg.qkv_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (hidden,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for proj, out_f, in_f in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
            shapes[p + f"mlp.{proj}.weight"] = (out_f, in_f)
            if cfg.mlp_bias:
                shapes[p + f"mlp.{proj}.bias"] = (out_f,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    return shapes


def num_parameters(cfg: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_weight_shapes(cfg).values())


def _destination(model: DecoderModel, name: str) -> torch.Tensor | None:
    """The tensor (or row range of a fused one) that HF tensor `name` fills; None if unknown."""
    cfg = model.config
    if name == "model.embed_tokens.weight":
        return model.embed_tokens.data
    if name == "model.norm.weight":
        return model.norm.weight.data
    if name == "lm_head.weight" and not cfg.tie_word_embeddings:
        return model.lm_head.data
    match = _LAYER_NAME.fullmatch(name)
    if match is None or int(match.group(1)) >= cfg.num_layers:
        return None
    layer, rest = model.layers[int(match.group(1))], match.group(2)
    module, _, kind = rest.rpartition(".")  # kind: "weight" or "bias"
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "self_attn.q_proj": (layer.attn.qkv_proj, 0, q),
        "self_attn.k_proj": (layer.attn.qkv_proj, q, q + kv),
        "self_attn.v_proj": (layer.attn.qkv_proj, q + kv, q + 2 * kv),
        "mlp.gate_proj": (layer.mlp.gate_up_proj, 0, inter),
        "mlp.up_proj": (layer.mlp.gate_up_proj, inter, 2 * inter),
    }
    plain = {
        "input_layernorm": layer.input_norm,
        "post_attention_layernorm": layer.post_attn_norm,
        "self_attn.o_proj": layer.attn.o_proj,
        "self_attn.q_norm": layer.attn.q_norm,
        "self_attn.k_norm": layer.attn.k_norm,
        "mlp.down_proj": layer.mlp.down_proj,
    }
    if module in fused:
        target, start, stop = fused[module]
        param = getattr(target, kind, None)
        return None if param is None else param.data[start:stop]
    target = plain.get(module)
    param = getattr(target, kind, None) if target is not None else None
    return None if param is None else param.data


def load_weights(model: DecoderModel, files: list[Path]) -> None:
    """Copies every tensor of `files` into `model`; raises on missing, unexpected or misshapen ones."""
    expected = set(expected_weight_shapes(model.config))
    seen: set[str] = set()
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.config.tie_word_embeddings:
                    continue  # tied: the head is the embedding, a saved copy is redundant
                dest = _destination(model, name) if name in expected else None
                if dest is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"{file.name}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                seen.add(name)
    missing = sorted(expected - seen)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {model.config.architecture}: "
            f"missing {len(missing)} tensors {missing[:8]}, unexpected {len(unexpected)} tensors {sorted(unexpected)[:8]}"
        )
