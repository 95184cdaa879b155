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
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
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


@dataclass(frozen=True)
class TokenBans:
    """Tokens forbidden on top of a grammar, where xgrammar 0.2.9 admits bytes that are not text.

    - UTF-16 surrogates (U+D800-DFFF, bytes ED A0-BF ..) pass its character classes; no valid
      UTF-8 holds them (Python decodes them as three U+FFFD, breaking maxLength). Banned inside a
      token, and across a token boundary: after a token ending in the lead byte ED, a token
      starting with A0-BF is banned.
    - JSON kinds also ban raw control bytes (0x00-0x1f): compact JSON never needs one, and the
      `maxLength` string rule lets them through, which json.loads rejects.
    Stop tokens are never banned.
    """

    always: torch.Tensor
    """[V] bool, forbidden whatever came before."""
    after_ed: torch.Tensor
    """[V] bool, forbidden right after a token ending in byte ED: `always` | starts with A0-BF."""
    ends_with_ed: frozenset[int]
    """Token ids whose last byte is ED."""

    @classmethod
    def for_vocab(cls, pieces: Sequence[bytes], stop: set[int], vocab_size: int, ban_control_bytes: bool) -> TokenBans:
        always = torch.zeros(vocab_size, dtype=torch.bool)
        tail = torch.zeros(vocab_size, dtype=torch.bool)
        ends = set()
        for i, piece in enumerate(pieces):
            if i in stop or not piece:
                continue
            if b"\xed" in piece and any(0xA0 <= piece[j + 1] <= 0xBF for j in range(len(piece) - 1) if piece[j] == 0xED):
                always[i] = True
            if ban_control_bytes and any(b < 0x20 for b in piece):
                always[i] = True
            if 0xA0 <= piece[0] <= 0xBF:
                tail[i] = True
            if piece[-1] == 0xED:
                ends.add(i)
        return cls(always, always | tail, frozenset(ends))


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
        self._bans: dict[bool, TokenBans] = {}

    def token_bans(self, spec: GrammarSpec) -> TokenBans:
        """What to forbid on top of the grammar for this spec (see TokenBans)."""
        json_kind = spec.kind in ("json_schema", "json_object")
        with self._lock:
            if json_kind not in self._bans:
                self._bans[json_kind] = TokenBans.for_vocab(
                    self.tokenizer_info.decoded_vocab[: self.vocab_size], set(self.tokenizer_info.stop_token_ids),
                    self.vocab_size, ban_control_bytes=json_kind,
                )  # fmt: skip
            return self._bans[json_kind]

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
            reason = _reason(e)
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
        if spec.kind == "structural_tag":
            return self._xgr.compile_structural_tag(structural_tag(spec.value))
        return self._xgr.compile_grammar(spec.value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def structural_tag(text: str) -> str:
    """A structural tag spec's value as compile_structural_tag takes it (JSON text): the older
    {structures, triggers} spelling becomes the triggered_tags format it stands for, and JSON
    parts get at most one whitespace character in a row unless they set max_whitespace_cnt (as
    json_schema requests are compact: small models otherwise loop on blanks; xgrammar takes no 0)."""
    tag = json.loads(text)
    if "structures" in tag:
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": tag["triggers"], "tags": [
            {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in tag["structures"]]}}  # fmt: skip
    _bound_whitespace(tag)
    return json.dumps(tag)


def _bound_whitespace(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            node.setdefault("max_whitespace_cnt", 1)
            return  # the schema itself is JSON Schema, not formats
        for value in node.values():
            _bound_whitespace(value)
    elif isinstance(node, list):
        for value in node:
            _bound_whitespace(value)


# "[15:42:17] /project/cpp/grammar_compiler.cc:1318: Check failed: (...) is false: " before the reason
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _reason(e: Exception) -> str:
    """xgrammar's message, first line, without the native code's location prefix."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return _NATIVE_PREFIX.sub("", text.splitlines()[0]) or type(e).__name__


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root is exactly one of the strings (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
