"""TextTokens: which token ids show text alone (the tiny model's real byte-level tokenizer)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from common.sampling.text_tokens import FIRST_TEXT_TOKENS, TextTokens


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def kinds(tokenizer):
    """(a special token, a lone byte that is not a whole character, a token with visible text)."""
    special = tokenizer.all_special_ids[0]
    lone_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    visible = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]).strip().isalpha())
    return special, lone_byte, visible


def test_special_tokens_and_lone_bytes_show_no_text(tokenizer, kinds):
    special, lone_byte, visible = kinds
    text = TextTokens(tokenizer)
    assert not text(special)  # skipped in the response's text
    assert not text(lone_byte)  # half a character: the detokenizer holds it back
    assert text(visible)
    assert text(visible)  # cached: the same answer


def test_awaits_text_until_a_token_before_this_step_showed_text(tokenizer, kinds):
    special, lone_byte, visible = kinds
    text = TextTokens(tokenizer)
    # A prompt step's first token: nothing came before it in this request.
    assert not text.awaits_text([special], 1)
    # The tokens before this step showed no text: this step may start the first character.
    assert text.awaits_text([special, visible], 1)
    assert text.awaits_text([lone_byte, lone_byte, lone_byte], 1)
    assert text.awaits_text([special, lone_byte, visible], 2)
    # Text already went out before this step: stream normally.
    assert not text.awaits_text([visible, special], 1)
    assert not text.awaits_text([special, visible, lone_byte], 1)
    # Past the first few tokens a request streams normally, text or not.
    assert text.awaits_text([special] * FIRST_TEXT_TOKENS, 1)
    assert not text.awaits_text([special] * (FIRST_TEXT_TOKENS + 1), 1)
