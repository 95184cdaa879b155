"""Seeded random-weight HF model folders, loadable by Tandem and by transformers.

    make_model("llama", "tiny", seed=0, out_dir) ->
        out_dir/config.json, generation_config.json, model.safetensors,
        tokenizer.json, tokenizer_config.json, chat_template.jinja (+ special tokens map)

The tokenizer is a byte-level BPE trained offline on `tokenizer_corpus.txt` (prose, code, numbers,
accented Latin, CJK, emoji), the same for every arch and size; the seed only drives the weights.
Each arch switches on its own features so the parity tests exercise them (see _arch_overrides).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.models.architectures import SHORT_NAMES
from common.models.config import ModelConfig

CORPUS_PATH = Path(__file__).with_name("tokenizer_corpus.txt")
SIZES = ("tiny", "small")

# Special tokens take the first ids, in this order.
PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# ChatML. No BOS: the tokenizer adds none either, so prompts from both paths match.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

VOCAB_SIZE = 1024

# Init scales (std = gain / sqrt(fan_in) for projections), tuned by measuring greedy variety.
EMBED_STD = 1.0
HEAD_GAIN = 4.0  # logits std ~ HEAD_GAIN: peaked but not one-hot
QK_GAIN = 2.0  # sharper attention, so position (RoPE) and context steer the next token
BIAS_STD = 0.1
TIED_EMBED_GAIN = 0.25  # tied models: a small embedding, the final norm restores logit scale

SIZE_SHAPES: dict[str, dict[str, Any]] = {
    # ~1M parameters: the default model for tests and `make up`.
    "tiny": dict(
        hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, dtype="float32",
    ),
    # ~100M parameters: for benchmarks.
    "small": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=8192, dtype="bfloat16",
    ),
}


def _arch_overrides(arch: str, size: str) -> dict[str, Any]:
    """What each arch changes, so every family's special feature is exercised."""
    heads = SIZE_SHAPES[size]["num_attention_heads"]
    head_dim = SIZE_SHAPES[size]["hidden_size"] // heads
    if arch == "llama":
        return dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=1024,
            ),
        )
    if arch == "qwen2":  # q/k/v biases, tied head
        return dict(tie_word_embeddings=True, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    if arch == "qwen3":  # q/k norms, head_dim not hidden / heads
        return dict(
            tie_word_embeddings=False, head_dim=head_dim + 16,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        )
    if arch == "mistral":  # MHA; a window longer than any context is plain causal attention
        return dict(
            tie_word_embeddings=False, num_key_value_heads=heads,
            sliding_window=2 * SIZE_SHAPES[size]["max_position_embeddings"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
    if arch == "granite":  # all four multipliers, plus attention and MLP biases
        return dict(
            tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
            embedding_multiplier=6.0, attention_multiplier=1.0 / head_dim, residual_multiplier=0.5,
            logits_scaling=2.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        )
    raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SHORT_NAMES)}")


def make_model(arch: str, size: str, seed: int, out_dir: str | Path) -> Path:
    """Writes a seeded random-weight HF folder for `arch` ({llama,qwen2,qwen3,mistral,granite})."""
    if arch not in SHORT_NAMES:
        raise ValueError(f"unknown arch {arch!r}; supported: {', '.join(SHORT_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; supported: {', '.join(SIZES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    raw = _hf_config(arch, size)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    generation = dict(bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID, do_sample=False)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    cfg = ModelConfig.from_dict(raw, generation)
    save_file(random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(out, model_max_length=cfg.max_position_embeddings)
    return out


def _hf_config(arch: str, size: str) -> dict[str, Any]:
    architecture = SHORT_NAMES[arch]
    raw: dict[str, Any] = dict(
        architectures=[architecture], model_type=arch, vocab_size=VOCAB_SIZE, hidden_act="silu",
        rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        attention_bias=False, tie_word_embeddings=False, use_cache=True,
    )
    raw.update(SIZE_SHAPES[size])
    raw.update(_arch_overrides(arch, size))
    return raw


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors drawn from one seeded generator, in a fixed order.

    Scales are chosen so greedy decoding wanders instead of locking onto one token (measured: 48
    greedy tokens from 8 prompts give ~40 distinct ids, no loops): projections keep activations
    near unit scale, q/k are sharpened so RoPE and context steer attention, and the head gives
    logits of std ~HEAD_GAIN so the argmax depends on the whole state, not the last token.
    """
    from common.models.loader import expected_weight_shapes

    gen = torch.Generator().manual_seed(seed)
    hidden = cfg.hidden_size
    head_std = HEAD_GAIN / math.sqrt(hidden)
    # A tied head scores each token against its own embedding, which the residual stream still
    # carries: a small embedding keeps that self-score weak, and the final norm's gain restores
    # the logit scale instead.
    embed_std = TIED_EMBED_GAIN / math.sqrt(hidden) if cfg.tie_word_embeddings else EMBED_STD
    final_norm_gain = HEAD_GAIN / TIED_EMBED_GAIN if cfg.tie_word_embeddings else 1.0
    # Granite multiplies the embedding; undo it in the init so the branches still matter.
    embed_std /= cfg.embedding_multiplier
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_weight_shapes(cfg).items():
        module, kind = name.split(".")[-2:]
        if name == "model.embed_tokens.weight":
            t = embed_std * torch.randn(shape, generator=gen)
        elif name == "lm_head.weight":
            t = head_std * torch.randn(shape, generator=gen)
        elif module.endswith("norm") or module.endswith("layernorm"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)  # not all ones, so a swapped norm shows
            if name == "model.norm.weight":
                t = final_norm_gain * t
            elif module in ("q_norm", "k_norm"):
                t = QK_GAIN * t  # Qwen3 renormalises q and k, so their sharpness lives here
        elif kind == "bias":
            t = BIAS_STD * torch.randn(shape, generator=gen)
        else:
            gain = QK_GAIN if module in ("q_proj", "k_proj") else 1.0
            t = (gain / math.sqrt(shape[1])) * torch.randn(shape, generator=gen)
        tensors[name] = t.to(cfg.dtype).contiguous()
    return tensors


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Byte-level BPE trained on the shipped corpus; cached so repeated make_model calls are cheap."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS_PATH.read_text(encoding="utf-8")
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer.to_str()


def save_tokenizer(out: Path, model_max_length: int, vocab_size: int = VOCAB_SIZE) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_trained_tokenizer_json(vocab_size))
    if backend.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer corpus too small: trained {backend.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        extra_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem make-model", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=list(SHORT_NAMES), default="llama")
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    args = parser.parse_args(argv)
    path = make_model(args.arch, args.size, args.seed, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
