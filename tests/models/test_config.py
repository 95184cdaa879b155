"""ModelConfig normalisation: both RoPE spellings, per-arch quirks, ids, dtypes, clear errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from common.models.config import ModelConfig, RopeConfig
from common.models.rope import rope_inv_freq

LLAMA3_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=1024)


def raw_config(arch: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = dict(
        architectures=[arch], vocab_size=1000, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )
    raw.update(overrides)
    return raw


def test_new_and_old_rope_spellings_agree():
    new = ModelConfig.from_dict(raw_config(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_ROPE)))
    old = ModelConfig.from_dict(raw_config(rope_theta=500000.0, rope_scaling=dict(type="llama3", **LLAMA3_ROPE)))
    assert new.rope == old.rope == RopeConfig(theta=500000.0, rope_type="llama3", **LLAMA3_ROPE)
    plain = ModelConfig.from_dict(raw_config(rope_theta=1e6))
    assert plain.rope == RopeConfig(theta=1e6)


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type="llama3", rope_theta=500000.0, **LLAMA3_ROPE)
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=params)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(ModelConfig.from_dict(raw_config(rope_parameters=params)).rope, head_dim=64)
    torch.testing.assert_close(ours, expected, atol=0, rtol=1e-6)
    # The three bands all occur at this size: kept, blended and slowed-down frequencies.
    base = rope_inv_freq(RopeConfig(theta=500000.0), head_dim=64)
    ratio = base / ours
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def test_ids_dtype_and_heads():
    cfg = ModelConfig.from_dict(
        raw_config(eos_token_id=2, bos_token_id=1, torch_dtype="bfloat16"),
        generation={"eos_token_id": [2, 4], "pad_token_id": 0},
    )
    assert cfg.eos_token_ids == [2, 4] and cfg.bos_token_id == 1 and cfg.pad_token_id == 0
    assert cfg.dtype == torch.bfloat16
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert ModelConfig.from_dict(raw_config(dtype="float16")).dtype == torch.float16
    assert ModelConfig.from_dict(raw_config(num_key_value_heads=None)).num_kv_heads == 4  # MHA
    assert ModelConfig.from_dict(raw_config()).attention_scale == 16**-0.5


def test_arch_quirks():
    qwen2 = ModelConfig.from_dict(raw_config("Qwen2ForCausalLM", head_dim=99, sliding_window=128))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.head_dim == 16  # Qwen2 ignores head_dim
    assert qwen2.sliding_window is None  # only counts with use_sliding_window
    qwen3 = ModelConfig.from_dict(raw_config("Qwen3ForCausalLM", head_dim=24))
    assert qwen3.qk_norm and qwen3.head_dim == 24 and qwen3.q_size == 96 and not qwen3.qkv_bias
    assert ModelConfig.from_dict(raw_config("Qwen3ForCausalLM")).head_dim == 128  # HF's default
    mistral = ModelConfig.from_dict(raw_config("MistralForCausalLM", sliding_window=1024))
    assert mistral.sliding_window == 1024 and mistral.max_model_len == 1024
    granite = ModelConfig.from_dict(
        raw_config(
            "GraniteForCausalLM", embedding_multiplier=12.0, attention_multiplier=0.0078125,
            residual_multiplier=0.22, logits_scaling=8.0, attention_bias=True,
        )
    )
    assert (granite.embedding_multiplier, granite.attention_scale) == (12.0, 0.0078125)
    assert (granite.residual_multiplier, granite.logits_scaling) == (0.22, 8.0)
    assert granite.qkv_bias and granite.o_bias
    # Multipliers only mean something to Granite.
    llama = ModelConfig.from_dict(raw_config(embedding_multiplier=12.0, logits_scaling=8.0))
    assert (llama.embedding_multiplier, llama.logits_scaling) == (1.0, 1.0)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (raw_config("GPT2LMHeadModel"), "unsupported architecture 'GPT2LMHeadModel'; supported: GraniteForCausalLM, "),
        (raw_config(architectures=[]), "exactly one architecture"),
        (raw_config(rope_parameters=dict(rope_type="yarn", factor=4.0)), "unsupported rope_type 'yarn'"),
        (raw_config(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        (raw_config(torch_dtype="float64"), "unsupported checkpoint dtype 'float64'"),
    ],
)
def test_clear_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)
