"""make_model: deterministic folders, per-arch features, and a tokenizer that handles real text."""

from __future__ import annotations

import time

import pytest

from common.models.config import ModelConfig
from common.models.loader import num_parameters
from common.models.make_model import (
    BOS_ID, CHAT_TEMPLATE, EOS_ID, IM_END_ID, IM_START_ID, PAD_ID, VOCAB_SIZE, _hf_config, main, make_model,
)

MULTI_BYTE = "Crème brûlée à Kraków, 今天天气很好, おはようございます, 안녕하세요 😀🚀 ☕ — ±√2"


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_factory("llama"))


def test_same_seed_same_folder_other_seed_other_weights(tmp_path):
    start = time.perf_counter()
    a = make_model("granite", "tiny", 7, tmp_path / "a")
    assert time.perf_counter() - start < 5.0  # tiny must stay cheap for tests
    b = make_model("granite", "tiny", 7, tmp_path / "b")
    c = make_model("granite", "tiny", 8, tmp_path / "c")
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_arch_features_and_sizes():
    cfgs = {arch: ModelConfig.from_dict(_hf_config(arch, "tiny")) for arch in ("llama", "qwen2", "qwen3", "mistral", "granite")}
    assert cfgs["llama"].rope.rope_type == "llama3" and not cfgs["llama"].tie_word_embeddings
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen2"].tie_word_embeddings
    qwen3 = cfgs["qwen3"]
    assert qwen3.qk_norm and qwen3.head_dim != qwen3.hidden_size // qwen3.num_heads
    mistral = cfgs["mistral"]
    assert mistral.num_kv_heads == mistral.num_heads and mistral.sliding_window > mistral.max_position_embeddings
    granite = cfgs["granite"]
    assert granite.embedding_multiplier != 1 and granite.residual_multiplier != 1 and granite.logits_scaling != 1
    assert granite.attention_scale != granite.head_dim**-0.5 and granite.mlp_bias
    for cfg in cfgs.values():
        assert cfg.vocab_size == VOCAB_SIZE and cfg.max_position_embeddings >= 4096
        assert 0.5e6 < num_parameters(cfg) < 2e6
        assert cfg.eos_token_ids == [EOS_ID] and cfg.bos_token_id == BOS_ID
    small = ModelConfig.from_dict(_hf_config("llama", "small"))
    assert 80e6 < num_parameters(small) < 130e6


def test_generation_config_adds_chat_eos(model_factory):
    cfg = ModelConfig.from_pretrained(model_factory("qwen2"))
    assert cfg.eos_token_ids == [EOS_ID, IM_END_ID] and cfg.pad_token_id == PAD_ID


def test_tokenizer_round_trips_multi_byte_text(tokenizer):
    ids = tokenizer(MULTI_BYTE)["input_ids"]
    assert tokenizer.decode(ids) == MULTI_BYTE
    assert len(tokenizer) == VOCAB_SIZE and max(ids) < VOCAB_SIZE
    # Some learned tokens are whole multi-byte characters (merged UTF-8 bytes), not just single bytes.
    pieces = [tokenizer.decode([i]) for i in range(VOCAB_SIZE)]
    multi_byte_tokens = [p for p in pieces if "\ufffd" not in p and any(ord(ch) > 0x7F for ch in p)]
    assert len(multi_byte_tokens) >= 20


def test_special_tokens_and_chat_template(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [IM_START_ID, IM_END_ID]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café? ☕"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCafé? ☕<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == IM_START_ID and ids.count(IM_END_ID) == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nCafé? ☕\nassistant\n"


def test_cli_main(tmp_path, capsys):
    assert main(["--arch", "qwen3", "--size", "tiny", "--seed", "3", "--out", str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    assert ModelConfig.from_pretrained(tmp_path / "q").architecture == "Qwen3ForCausalLM"
    with pytest.raises(SystemExit):
        main(["--arch", "gpt2", "--out", str(tmp_path / "x")])
