"""Helpers for engine tests: build engines and transformers references on the same weights."""

from __future__ import annotations

import random
from functools import lru_cache
from pathlib import Path

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams


def make_engine(
    model: Path,
    *,
    budget: int = 2048,
    num_blocks: int | None = 512,
    block_size: int = 16,
    prefix_caching: bool = True,
    max_num_seqs: int = 64,
    dtype: str = "float32",
    weight_dtype: str = "auto",
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            weight_dtype=weight_dtype,
            device="cpu",
            cache=CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        )
    )


def round_matrices_to_bf16(model: torch.nn.Module) -> None:
    """A float32 model's (ours or transformers') matrices rounded to bf16 values in place: what
    weight_dtype="bfloat16" stores, so float32 math over them is its reference."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.bfloat16().float())


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the first ids: the tokenizer keeps its special tokens there.
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@lru_cache(maxsize=8)
def _hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers generate(), one prompt at a time (no padding), EOS ignored."""
    hf = _hf_model(str(model))
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            outs.append(gen[0, len(p) :].tolist())
    return outs


def hf_logprobs(model: Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position: [len(output), vocab]."""
    hf = _hf_model(str(model))
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def assert_no_leaks(engine: LLMEngine) -> None:
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks still held after all requests ended"
