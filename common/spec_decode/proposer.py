"""What a proposer is: for each speculating request, up to k draft tokens (and their probabilities).

The engine asks once per step, for all speculating requests at once (one batched call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from common.sampling.params import SamplingParams


@dataclass(slots=True)
class ProposalRequest:
    request_id: str
    token_ids: list[int]
    """The request's whole context: prompt + every output token (the last one not yet computed)."""
    num_verified: int
    """len(token_ids) at this call; tokens past what the proposer saw last call are new."""
    k: int
    """Most draft tokens wanted (>= 1)."""
    params: SamplingParams


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]
    """0..k draft tokens continuing the context."""
    probs: torch.Tensor | None = None
    """[len(token_ids), vocab] float32: the distribution each draft token was drawn from; None
    means each token was chosen deterministically (a point mass), as the n-gram proposer does."""


class Proposer(Protocol):
    # Optional attribute `keeps_state: bool` (False when absent): the proposer holds per-request
    # state (a draft model's KV) that must ingest every token it missed before it can draft again,
    # at a prefill's cost. The engine then never resumes a request whose drafting lapsed (see
    # SpeculationMixin._propose); a stateless proposer (n-gram) is resumed freely.

    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        """Proposals by request id; a missing id means no speculation for it this step."""
        ...

    def release(self, request_ids: list[str]) -> None:
        """The requests finished or were aborted: drop whatever state is kept for them."""
        ...
