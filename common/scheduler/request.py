"""A request inside the engine, and its life cycle.

    WAITING --schedule--> RUNNING --last token--> FINISHED_STOPPED | FINISHED_LENGTH
       ^                    |   \
       |               preempt   abort (any state) --> FINISHED_ABORTED
       +---- PREEMPTED <----+

A RUNNING request holds KV blocks. It may still be prefilling (num_computed_tokens < num_tokens
by more than one token, fed in chunks) or decoding (exactly one new token per step, or k+1 when
verifying draft tokens). PREEMPTED requests gave their blocks back and recompute their whole
context when scheduled again. WAITING_FOR_REMOTE_KV is used by the decode service while a
prefill worker fills the request's reserved blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from common.sampling.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    """Resolved output budget (params.max_tokens, or what the context leaves)."""
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every generated token."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose K/V are in this request's blocks."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at first admission."""
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify in the next step (speculative decoding)."""
    spec_draft_probs: Any = None
    """[len(spec_token_ids), vocab] tensor the drafts were drawn from, or None (point mass)."""
    spec_enabled: bool = True
    """Per-request opt-out of speculative decoding."""
    adaptive_k: Any = None
    """AdaptiveK of this request when speculation is on."""
    spec_proposed_at: int = -1
    """Engine step whose drafts this request last verified (-1: never): a proposal long after it
    makes the draft catch up on every token since, a cost of resuming, not of drafting."""
    fork_parent: str | None = None
    """For n > 1: the sibling whose prompt blocks this one shares once they are computed."""
    # Per output token: (logprob of the chosen token, top-N list or None).
    logprobs: list[tuple[float, list[tuple[int, float]] | None]] = field(default_factory=list)
    # Prompt logprobs collected so far (params.prompt_logprobs set): one per prompt token after
    # the first, as (token id, logprob, top-N).
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet. Only the first choice reports them
        (siblings share its prompt), and a cached prefix would skip the positions they need."""
        wanted = self.params.prompt_logprobs is not None and self.fork_parent is None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
