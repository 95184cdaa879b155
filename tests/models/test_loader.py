"""load_model: dtypes, sharded checkpoints, tied heads, and clear errors on bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.models.loader import load_model
from tests.models.paged_helpers import PagedRunner

PROMPT = [1, 40, 300, 77, 512, 9, 800, 123, 55, 600, 21, 999]


def prompt_logits(path: Path, **kwargs) -> torch.Tensor:
    model, cfg = load_model(path, **kwargs)
    return PagedRunner(model, cfg).step({0: PROMPT})[0]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_auto_dtype_and_default_attention(model_factory):
    model, cfg = load_model(model_factory("llama"))
    assert cfg.dtype == torch.float32 and model.dtype == torch.float32
    assert model.layers[0].attn.backend.name == "torch"  # attention=None on CPU picks the torch path


def test_bfloat16_load(model_factory):
    path = model_factory("qwen3")
    model, cfg = load_model(path, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    logits = PagedRunner(model, cfg).step({0: PROMPT})[0]
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    reference = prompt_logits(path, dtype="float32")
    # bf16 keeps ~3 significant digits: logits move by a few tenths (std ~4), predictions mostly hold.
    assert (logits - reference).abs().max() < 0.25 * reference.std()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_float16_load_runs(model_factory):
    model, cfg = load_model(model_factory("granite"), dtype=torch.float16)
    assert model.dtype == torch.float16
    assert torch.isfinite(PagedRunner(model, cfg).step({0: PROMPT})[0]).all()


def test_sharded_checkpoint_loads(model_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    path = model_factory("mistral")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(sharded, max_shard_size="300KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()
    torch.testing.assert_close(prompt_logits(sharded), prompt_logits(path), atol=0, rtol=0)


def test_tied_and_untied_heads(model_factory):
    tied, tied_cfg = load_model(model_factory("qwen2"))
    assert tied_cfg.tie_word_embeddings and tied.lm_head is tied.embed_tokens
    assert "lm_head.weight" not in load_file(model_factory("qwen2") / "model.safetensors")
    untied, untied_cfg = load_model(model_factory("llama"))
    assert not untied_cfg.tie_word_embeddings and not torch.equal(untied.lm_head, untied.embed_tokens)


def test_missing_tensor_is_named(model_factory, tmp_path):
    path = copy_model(model_factory("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(path)


def test_unexpected_tensor_is_named(model_factory, tmp_path):
    path = copy_model(model_factory("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)  # llama has no q_norm
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected 1 tensors.*q_norm"):
        load_model(path)


def test_wrong_shape_is_named(model_factory, tmp_path):
    path = copy_model(model_factory("llama"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(7,\)"):
        load_model(path)


def test_unsupported_architecture_message(model_factory, tmp_path):
    path = copy_model(model_factory("llama"), tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path)


def test_bad_dtype_and_missing_folder(model_factory, tmp_path):
    with pytest.raises(ValueError, match="dtype must be"):
        load_model(model_factory("llama"), dtype="float64")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
