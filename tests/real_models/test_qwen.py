"""Qwen2.5-Coder-0.5B-Instruct (real weights; a 478 MB download): greedy parity with transformers in
the engine, batched and chunked; the model's own chat template; both end-of-turn ids stop a turn.

Marked `qwen`: skipped unless TANDEM_QWEN_TESTS=1 (too big for every CI run); the result of the
last run is recorded in docs/models.md.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.models.config import ModelConfig
from common.sampling.params import SamplingParams
from services.gateway.model import ServedModel
from tests.engine.engine_helpers import assert_no_leaks, make_engine
from tests.real_models.real_model_helpers import CHATS, QWEN_05B, chat_prompts, hf_chat_greedy, real_model

pytestmark = pytest.mark.qwen
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen() -> object:
    return real_model(QWEN_05B)


def test_eos_ids_are_both_end_of_turn_tokens(qwen) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen))
    eos = ModelConfig.from_pretrained(qwen).eos_token_ids
    assert set(eos) == {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}


def test_chat_template_renders_like_transformers(qwen) -> None:
    tok = AutoTokenizer.from_pretrained(str(qwen))
    assert "You are Qwen, created by Alibaba Cloud" in tok.chat_template
    served = ServedModel.load(qwen, "qwen")
    for messages in CHATS:
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert served.tokenize_chat(messages) == list(want), messages


def test_greedy_parity_batched_and_chunked(qwen) -> None:
    prompts = chat_prompts(qwen)
    reference = hf_chat_greedy(qwen, prompts, MAX_TOKENS)
    engine = make_engine(qwen, budget=48)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == reference
    assert_no_leaks(engine)
