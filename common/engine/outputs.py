"""What crosses the engine's boundary: its outputs, errors, and hook payloads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


class RequestError(ValueError):
    """A request the engine cannot serve; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(slots=True)
class CompletionOutput:
    """What one step produced for one sequence (a choice of a request)."""

    request_id: str
    """The id given to add_request (shared by the n choices)."""
    index: int
    """Choice index, 0..n-1."""
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, list[tuple[int, float]] | None]]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int] = field(default_factory=list)
    """All output tokens so far."""
    text: str = ""
    """All output text so far (when the engine detokenizes)."""
    logprobs: list[tuple[float, list[tuple[int, float]] | None]] = field(default_factory=list)
    """Per output token so far: (logprob of the chosen token, top-N or None)."""
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    """On choice 0's first output when params.prompt_logprobs is set: one (token id, logprob,
    top-N) per prompt token after the first."""


def coalesce(items: list) -> list:
    """Each choice's consecutive outputs merged into one, up to the next item that is not an output
    (kept in place): what a consumer that fell a few steps behind sends on as one message. Each
    choice's tokens stay in order; choices of a request are independent streams. Linear in the
    items: each run is joined once (a run of 25 decode steps is what a 10 ms streaming interval
    hands over for the tiny model)."""
    merged: list = []
    open_at: dict[tuple[str, int], int] = {}  # choice -> its run's place in merged since the last other item
    for item in items:
        if not isinstance(item, CompletionOutput):
            merged.append(item)
            open_at.clear()
            continue
        at = open_at.get((item.request_id, item.index))
        if at is None:
            open_at[(item.request_id, item.index)] = len(merged)
            merged.append(_Run([item]))
        else:
            merged[at].outputs.append(item)
    return [_joined(m.outputs) if isinstance(m, _Run) else m for m in merged]


@dataclass(slots=True)
class _Run:
    outputs: list[CompletionOutput]


def _joined(run: list[CompletionOutput]) -> CompletionOutput:
    """The last output's state (finish, totals so far) with every output's new tokens, logprobs
    and text, in order."""
    if len(run) == 1:
        return run[0]
    first = next((o.prompt_logprobs for o in run if o.prompt_logprobs is not None), None)
    return dataclasses.replace(
        run[-1], new_token_ids=[t for o in run for t in o.new_token_ids],
        new_logprobs=[lp for o in run for lp in o.new_logprobs], text_delta="".join(o.text_delta for o in run),
        prompt_logprobs=first,
    )  # fmt: skip


@dataclass(slots=True)
class StepTimings:
    """Wall-clock split of the last step, for profiling and metrics (seconds)."""

    schedule: float = 0.0
    model: float = 0.0
    sample: float = 0.0
    """Sampling and draft verification."""
    bookkeeping: float = 0.0
    """Appending tokens: stop checks and incremental detokenization."""
    total: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0


@dataclass(slots=True)
class Reservation:
    """Blocks a decode worker set aside for a prompt whose KV a prefill worker will push."""

    request_id: str
    block_ids: list[int]
    """The request's whole block table, covering every prompt position."""
    num_cached_tokens: int
    """Leading prompt tokens already in this worker's prefix cache: their blocks must not be sent."""


@dataclass(slots=True)
class ComputedSpan:
    """Prompt positions [start, end) of a request whose K/V the last step wrote (prefill hook)."""

    request_id: str
    start: int
    end: int
    block_ids: list[int]
    """The request's block table at that moment (positions -> slots)."""
