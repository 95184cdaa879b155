"""GrammarSpec -> xgrammar CompiledGrammar for one tokenizer: off the engine thread, bounded in
time, cached.

    compile(spec) ── cache hit ─────────────────────────────────────────> CompiledGrammar
          │ miss
          └─> pool thread: xgrammar compile ── done within timeout_s ───> cached, returned
                       (one in flight per spec)  └─ still running ───────> GrammarCompileError
                                                   (it finishes in the background and is cached)

A compiled grammar depends on the spec and the tokenizer's vocabulary; one compiler serves one
tokenizer, so its cache is keyed by (spec, tokenizer). Callers on an event loop run `compile` in a
worker thread before handing the request to the engine (`EngineLoop.prepare`), so the engine
thread only ever sees cache hits and never waits on a compile.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import xgrammar as xgr

from common.structured.spec import GrammarSpec

_MAX_REASON_CHARS = 400


class GrammarCompileError(ValueError):
    """The spec cannot be compiled (invalid, or too slow); `field` is the request field it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer. Thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        max_threads: int = 2,
    ) -> None:
        """tokenizer: a Hugging Face tokenizer; vocab_size: the model's logits width (may exceed the
        tokenizer's); stop_token_ids: the ids that end a request (the model's EOS ids)."""
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._xgr = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, Future] = {}
        self._control_tokens: torch.Tensor | None = None

    def banned_tokens(self, spec: GrammarSpec) -> torch.Tensor | None:
        """[V] bool of tokens to forbid on top of the grammar, or None.

        JSON kinds: every token holding a raw control byte (0x00-0x1f). Compact JSON never needs
        one, and xgrammar 0.2.9's length-bounded string rule (`maxLength`) lets them through,
        which json.loads rejects. Stop tokens stay allowed.
        """
        if spec.kind not in ("json_schema", "json_object"):
            return None
        with self._lock:
            if self._control_tokens is None:
                banned = torch.zeros(self.vocab_size, dtype=torch.bool)
                stop = set(self.tokenizer_info.stop_token_ids)
                for i, piece in enumerate(self.tokenizer_info.decoded_vocab[: self.vocab_size]):
                    if i not in stop and any(b < 0x20 for b in piece):
                        banned[i] = True
                self._control_tokens = banned
            return self._control_tokens

    def cached(self, spec: GrammarSpec) -> xgr.CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar; waits at most timeout_s. Raises GrammarCompileError."""
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        with self._lock:
            future = self._pending.get(spec)
            if future is None:
                future = self._pending[spec] = self._pool.submit(self._build, spec)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise GrammarCompileError(
                spec.source,
                f"the {spec.kind} did not compile within {self.timeout_s:g} s (too complex for the "
                "grammar engine); simplify it, or raise --grammar-compile-timeout",
            ) from None

    def _build(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            compiled = self._compile_now(spec)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with the reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarCompileError(spec.source, f"invalid {spec.kind}: {reason[:_MAX_REASON_CHARS]}") from None
        finally:
            with self._lock:
                self._pending.pop(spec, None)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile_now(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            # Compact JSON (no free whitespace): small models otherwise can loop on blanks forever.
            # strict_mode: properties the schema does not name are not allowed (OpenAI's strict).
            return self._xgr.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.value)
        if spec.kind == "choice":
            return self._xgr.compile_grammar(choice_grammar(spec.choices))
        return self._xgr.compile_grammar(spec.value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root is exactly one of the strings (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
