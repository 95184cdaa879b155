"""Domain types the gateway's edges (REST, gRPC) and its orchestrator exchange. No protobuf here.

Life of a gateway request:
    parsed + validated (GenerationRequest) -> admitted (admission queue) -> routed (decode worker,
    maybe a prefill worker + reservation) -> streaming (GenerationUpdate per decode message)
    -> finished (every choice has a finish_reason; last update carries Usage) | failed | aborted
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling.params import SamplingParams


@dataclass(slots=True)
class GenerationRequest:
    """One validated request. params.max_tokens is always resolved (never None)."""

    request_id: str  # the client's id (or one the gateway made up)
    model: str
    prompt_token_ids: list[int]
    params: SamplingParams
    return_token_ids: bool = False
    disable_speculative_decoding: bool = False
    max_tokens_defaulted: bool = False  # the client did not set it: limits may shrink it to fit
    max_tokens_field: str = "max_tokens"  # the name the client used (errors name it)
    owner: str = ""  # an opaque id of the caller (caller.py); "" for REST, whose ids are server-issued

    @property
    def scoped_id(self) -> str:
        return scoped_id(self.owner, self.request_id)


def scoped_id(owner: str, request_id: str) -> str:
    """A request's key among running ones: only its owner can name it to Abort, and the same
    client-chosen id from two callers names two requests."""
    return f"{owner}/{request_id}" if owner else request_id


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None only for an echoed first prompt token (nothing predicts it)
    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class ChoiceUpdate:
    """A choice's progress: new tokens, the text they made final, and its end when it ends."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None  # None when the request did not ask for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class GenerationUpdate:
    choices: list[ChoiceUpdate]
    usage: Usage | None = None  # on the last update only
    # Once, when params.prompt_logprobs is set: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class ChoiceResult:
    """A finished choice (for non-streaming answers), assembled from its updates."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, update: ChoiceUpdate) -> None:
        self.text += update.text
        self.token_ids.extend(update.token_ids)
        if update.logprobs is not None:
            self.logprobs = (self.logprobs or []) + update.logprobs
        if update.finish_reason is not None:
            self.finish_reason, self.stop_reason = update.finish_reason, update.stop_reason


def collect(updates: list[GenerationUpdate], n: int) -> tuple[list[ChoiceResult], Usage | None]:
    """Folds a finished request's updates into per-choice results and its usage."""
    results = [ChoiceResult(index=i) for i in range(n)]
    usage = None
    for update in updates:
        for choice in update.choices:
            results[choice.index].add(choice)
        usage = update.usage or usage
    return results, usage


def prompt_logprobs_of(updates: list[GenerationUpdate]) -> list[TokenLogprob] | None:
    return next((u.prompt_logprobs for u in updates if u.prompt_logprobs is not None), None)
