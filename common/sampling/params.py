"""Per-request sampling parameters, validated once at the edge.

`SamplingParams` is immutable: the engine derives variants with `dataclasses.replace`, which
re-runs validation. Every check raises `SamplingParamsError(field, message)` so the API layer
can answer 400 with the offending field and value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from common.structured.spec import GrammarSpec, GrammarSpecError

MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Seeds cross services as protobuf int64 (and vLLM's range is torch.long's too); a wider one
# could not be sent, so it is refused here, before any service reserves anything for it.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the tokens of one request (OpenAI names and semantics where they exist)."""

    n: int = 1
    """Number of completions to generate for the prompt (>= 1)."""
    max_tokens: int | None = 16
    """Most output tokens (>= 1); None means up to the model's context limit."""
    min_tokens: int = 0
    """EOS and `stop_token_ids` are masked until this many tokens are out (0 <= min <= max)."""
    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 means greedy (exact argmax, no randomness)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest top set with probability mass >= top_p (0 < p <= 1)."""
    top_k: int = -1
    """Keep the k most likely tokens (ties at the k-th value kept); -1 or 0 turns it off."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p * (most likely token's probability)."""
    seed: int | None = None
    """Per-request RNG seed: tokens then depend only on the seed and the request's own history."""
    presence_penalty: float = 0.0
    """OpenAI: subtract this from the logit of every token already in the output (-2..2)."""
    frequency_penalty: float = 0.0
    """OpenAI: subtract this times the token's count in the output (-2..2)."""
    repetition_penalty: float = 1.0
    """HF/CTRL: for tokens seen in prompt+output, divide positive logits, multiply negative (> 0)."""
    stop: tuple[str, ...] = ()
    """Stop strings (a str or a list is accepted; stored as a tuple); the text is cut at the first."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the request besides EOS (a list is accepted; stored as a tuple)."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks); EOS is then not masked by min_tokens either."""
    logprobs: int | None = None
    """None: no top alternatives; N in 0..20: also return the N most likely tokens per step."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text instead of cutting it off."""
    prompt_logprobs: int | None = None
    """None: none; N in 0..20: the logprob of every prompt token after the first (under the model's
    raw logits at the position before it) plus the N most likely tokens there (vLLM's field)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """OpenAI logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before sampling
    (a {"id": bias} mapping is accepted; stored sorted, as a tuple). Ids are checked against the
    vocabulary by whoever knows it (the gateway, the engine)."""
    grammar: GrammarSpec | None = None
    """Structured output: the whole output must match this grammar (a dict of its wire form is
    accepted). The grammar completing ends the request with finish_reason "stop"."""

    def __post_init__(self) -> None:
        # Normalise containers first so the frozen instance is hashable and cannot be mutated
        # behind the engine's back through a list the caller still holds.
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Sequence):
            stop = tuple(stop)
        else:
            raise SamplingParamsError("stop", f"expected a string or a list of strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        stop_ids = self.stop_token_ids
        if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, Sequence):
            raise SamplingParamsError("stop_token_ids", f"expected a list of ints, got {stop_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if isinstance(self.grammar, Mapping):
            try:
                object.__setattr__(self, "grammar", GrammarSpec.from_dict(self.grammar))
            except GrammarSpecError as e:
                raise SamplingParamsError(e.field, e.message) from None
        self.validate()

    def validate(self) -> None:
        """Raises SamplingParamsError naming the first bad field and its value."""
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        _check_float("temperature", self.temperature, low=0.0)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, low=-1)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=_SEED_MIN, high=_SEED_MAX)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", f"entry {i} must be a non-empty string, got {s!r}")
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise SamplingParamsError(
                    "stop_token_ids", f"entry {i} must be a non-negative int, got {t!r}"
                )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise SamplingParamsError(name, f"must be a bool, got {value!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for token, bias in self.logit_bias:
            if token < 0:
                raise SamplingParamsError("logit_bias", f"token id {token} must be >= 0")
            _check_float("logit_bias", bias, low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise SamplingParamsError("grammar", f"must be a GrammarSpec, got {self.grammar!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Builds params from an OpenAI-style request body's sampling fields.

        A null value means "use the default" (clients send null for unset fields). Also accepted:
        `max_completion_tokens` (chat alias of max_tokens) and the chat form of logprobs,
        `logprobs: bool` + `top_logprobs: int`. Unknown keys are rejected with the key named;
        pick the sampling fields out of the body before calling this.
        """
        if not isinstance(d, Mapping):
            raise SamplingParamsError("<body>", f"expected an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in ("max_completion_tokens", "top_logprobs"):
                continue
            if key not in known:
                raise SamplingParamsError(str(key), "unknown sampling parameter")
            if value is not None:
                kwargs[key] = value
        alias = d.get("max_completion_tokens")
        if alias is not None:
            if "max_tokens" in kwargs and kwargs["max_tokens"] != alias:
                raise SamplingParamsError(
                    "max_completion_tokens",
                    f"conflicts with max_tokens ({kwargs['max_tokens']!r} != {alias!r})",
                )
            kwargs["max_tokens"] = alias
        top_logprobs = d.get("top_logprobs")
        chat_logprobs = kwargs.get("logprobs")
        if isinstance(chat_logprobs, bool):
            # Chat API: logprobs switches log-probabilities on, top_logprobs says how many.
            kwargs["logprobs"] = (0 if top_logprobs is None else top_logprobs) if chat_logprobs else None
        elif top_logprobs is not None:
            raise SamplingParamsError("top_logprobs", "requires logprobs to be true")
        return cls(**kwargs)


def _normalise_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"123": 5} (JSON keys are strings), {123: 5} or [(123, 5)] -> ((123, 5.0),), sorted by id."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (Sequence, type({}.items()))):
        raise SamplingParamsError("logit_bias", f"expected a map of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for entry in items:
        if not isinstance(entry, Sequence) or len(entry) != 2:
            raise SamplingParamsError("logit_bias", f"expected (token id, bias) pairs, got {entry!r}")
        key, bias = entry
        try:
            token = key if isinstance(key, int) and not isinstance(key, bool) else int(str(key), 10)
        except ValueError:
            raise SamplingParamsError("logit_bias", f"keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise SamplingParamsError("logit_bias", f"bias of token {token} must be a number, got {bias!r}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    # bool is an int subclass; `"n": true` is a client bug, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise SamplingParamsError(name, f"must be {bound}, got {value}")


def _check_float(
    name: str,
    value: Any,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value > high):
        left = "(" if low_open else "["
        bound = f"{'>' if low_open else '>='} {low}" if high is None else f"in {left}{low}, {high}]"
        raise SamplingParamsError(name, f"must be {bound}, got {value}")
