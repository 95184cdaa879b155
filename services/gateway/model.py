"""The served model as the gateway sees it: name, tokenizer, context window, vocabulary.

The gateway never loads weights: it reads config.json (context length, vocabulary size) and the
tokenizer, which it uses for chat templates, tokenization and detokenization.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.models.config import ModelConfig
from services.gateway.errors import InvalidRequest


@dataclass
class ServedModel:
    name: str
    tokenizer: Any  # a transformers tokenizer
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))
    tool_call_parser: str = "auto"  # services/gateway/tool_parsers.py: hermes, llama3_json or auto

    @classmethod
    def load(cls, path: str | Path, name: str) -> ServedModel:
        from transformers import AutoTokenizer

        config = ModelConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        # The tokenizer may know more ids than the embedding (or fewer): the model's bound wins.
        return cls(name=name, tokenizer=tokenizer, max_model_len=config.max_model_len,
                   vocab_size=config.vocab_size)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: no token covers more text than this, so a
        text of C characters has at least C / max_token_chars tokens (limits.py)."""
        ids = list(range(len(self.tokenizer)))
        return max(1, max((len(str(t)) for t in self.tokenizer.convert_ids_to_tokens(ids)), default=1))

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequest(f"model {self.name!r} has no chat template; use /v1/completions",
                                 param="messages")
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools)
        except Exception as e:  # a template that rejects the conversation (roles, order, ...)
            raise InvalidRequest(f"the chat template rejected the messages: {e}", param="messages") from e

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template writes BOS/special tokens itself; adding them again would double BOS.
        return self.tokenize(self.render_chat(messages, add_generation_prompt, tools), add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(ids))]
