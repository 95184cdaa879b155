"""Incremental, UTF-8-safe detokenization of one request's output.

Byte-level BPE tokens need not end on a character boundary: "é" may be two tokens, an emoji
four. Decoding each token alone would emit U+FFFD halves, and re-decoding the whole output every
step costs O(length) per token. We keep two offsets into the token ids instead:

    ids:   [ ... p0 p1 | o0 o1 o2 | o3 o4 ]
                       ^prefix    ^read
    prefix_text = decode(ids[prefix:read])     text already emitted, re-decoded for context
    new_text    = decode(ids[prefix:])         the same plus the unread tokens

If new_text is longer than prefix_text and does not end in U+FFFD (an incomplete character),
new_text[len(prefix_text):] is final: emit it and slide both offsets forward. Otherwise hold the
tokens until a later token completes the character. Each step decodes only the short window.

The window starts in the last few prompt tokens, so the first output tokens decode the way they
would mid-text (tokenizers that drop a leading space at the start of a decode). For byte-level
BPE the emitted deltas, plus `finish()`, concatenate to exactly
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.

Wiring with stop strings (see stop_strings.py), per engine step:

    check = matcher.add_text(detok.add_tokens(new_ids))   # check.text: stream it; check.stop: done
    ... when the request ends for another reason (EOS, max_tokens):
    tail = matcher.add_text(detok.finish()).text + matcher.flush()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:  # transformers 5's tokenizers-backed base class (text_decoder's fast path)
    from transformers.tokenization_utils_tokenizers import TokenizersBackend
except ImportError:  # pragma: no cover - another transformers layout: the generic path
    TokenizersBackend = None

# Prompt tokens kept as decoding context; a few suffice to cover one character or one word.
_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"
"""What a decoder renders for an incomplete character."""


def text_decoder(tokenizer: Any) -> Callable[[Sequence[int], bool], str]:
    """decode(ids, skip_special_tokens) without clean-up, as `tokenizer.decode` does it.

    For a transformers tokenizer backed by the Rust `tokenizers` library whose decoding is the
    backend's own (no subclass changes it), that library is called directly: transformers'
    Python around it (argument conversion, batching checks, keyword plumbing) cost ~3x the
    decode itself, twice per streamed token in the gateway (py-spy, tiny model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    own = getattr(type(tokenizer), "_decode", None)
    if TokenizersBackend is not None and own is TokenizersBackend._decode and backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas that are final and UTF-8 complete."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        """tokenizer: a transformers tokenizer (anything with `decode(ids, skip_special_tokens=)`)."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = text_decoder(tokenizer)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # A prompt that ends mid-character would make its completion in the output render as a
        # character the output alone does not contain; start without context then.
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        # The window ids[prefix:]; older ids are dropped as it slides, so prefix is always 0.
        self._ids: list[int] = context
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)  # decode(ids[:read]), cached
        self.output_text = ""  # everything emitted so far
        self.num_output_tokens = 0
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(ids, self.skip_special_tokens)

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Appends output tokens; returns only the text that became final with them."""
        if self.finished:
            raise RuntimeError("add_tokens() after finish()")
        self._ids.extend(new_ids)
        self.num_output_tokens += len(new_ids)
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or the last character is still incomplete
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: what was unread becomes the context prefix of the next step.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        # Re-decoded rather than set to delta: the window now starts at a new token, and some
        # decoders render a window's first token differently (dropped leading space).
        self._prefix_text = self._decode(self._ids)
        self.output_text += delta
        return delta

    def finish(self) -> str:
        """The request ended: returns any held-back text, with U+FFFD for a truly cut character."""
        if self.finished:
            return ""
        self.finished = True
        new_text = self._decode(self._ids)
        delta = new_text[len(self._prefix_text) :]
        self.output_text += delta
        return delta
