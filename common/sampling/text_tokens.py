"""Which token ids show text on their own, for streams that must not hold back a first character.

A client's time to first token is the time to its first *visible* text: OpenAI-style streams
(and benchmark clients such as guidellm) count the first chunk whose text is not empty. A token
may add no text: a special token the response skips, or one byte of a character that spans
several tokens (byte-level BPE, byte fallback). A streamer that batches tokens (the decode
worker's streaming interval) would then hold the first character back behind a whole interval
of later tokens. `TextTokens` answers, per token id, whether decoding it alone gives complete,
non-empty text, so such a streamer can hand a request's tokens over one step at a time until
its text has started.

The answer is cached per id (one decode of one token the first time it is asked); only the
first few tokens of a request are ever asked about, so the cache stays small.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from common.sampling.detokenizer import REPLACEMENT_CHAR

logger = logging.getLogger(__name__)

FIRST_TEXT_TOKENS = 8
"""Past this many output tokens a request is streamed normally even if none showed text alone:
a character is at most 4 bytes (4 byte tokens), plus a few special tokens before it."""


class TextTokens:
    """token id -> decodes alone to complete, non-empty text (special tokens skipped)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, bool] = {}

    def __call__(self, token_id: int) -> bool:
        shown = self._cache.get(token_id)
        if shown is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=True, clean_up_tokenization_spaces=False)
            shown = self._cache[token_id] = bool(text) and not text.endswith(REPLACEMENT_CHAR)
        return shown

    def awaits_text(self, output_ids: list[int], num_new: int) -> bool:
        """True when the tokens before this step's `num_new` showed no text alone (within the
        first FIRST_TEXT_TOKENS): this step's tokens may start (or complete) the first character,
        so they should reach the client at once."""
        before = len(output_ids) - num_new
        if before <= 0 or len(output_ids) > FIRST_TEXT_TOKENS:
            return False  # a prompt step's first token goes out anyway; late tokens stream normally
        return not any(self(t) for t in output_ids[:before])


def load_text_tokens_async(load_tokenizer: Callable[[], Any], on_ready: Callable[[TextTokens], None]) -> threading.Thread:
    """Calls load_tokenizer (e.g. LLMEngine.vocab_tokenizer) on a background thread (a service's
    startup must not wait for it) and hands a TextTokens over it to on_ready. A model without a
    usable tokenizer leaves the caller without one: every token then counts as text, which is the
    plain streaming."""

    def load() -> None:
        try:
            on_ready(TextTokens(load_tokenizer()))
        except Exception as exc:  # optional: streaming works without it, only less eagerly
            logger.info("no tokenizer for first-text streaming: %s", exc)

    thread = threading.Thread(target=load, name="text-tokens", daemon=True)
    thread.start()
    return thread
