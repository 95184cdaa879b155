"""Per-request number of draft tokens, from its running acceptance rate.

With per-token acceptance rate a, k drafts yield on average (1 - a^(k+1)) / (1 - a) tokens per
verification pass, at a cost that grows with k (draft steps + wider verification). We pick the k
in [0, max_k] that maximises tokens per unit cost, cost = 1 + c * k, where c is the price of a
draft token that the engine measures on this machine and batch (step_cost.py; the prior 0.15
until it has). At k = 0 (plain decoding) a request probes with k = 1 when the engine says so
(`probe=True`, one step in PROBE_EVERY, the same step for every request) so it can recover.
Probes are synchronised on purpose: the verification tokens they add cost the same in one step
or spread over sixteen, but one batched draft call is far cheaper than sixteen single-sequence
ones (a draft step streams the draft's weights whatever its batch); measured at batch 16 on the
CPU, spreading them cost ~10% of throughput.

A new request starts from the engine's recent acceptance rate (AcceptancePrior): acceptance is
mostly a property of the draft/target pair and the workload, so a poor draft is not tried at
full k by every new request, and a good one is used at once instead of being learnt anew (at
k = 0 a request only learns through its probes).
"""

from __future__ import annotations

from dataclasses import dataclass

PROBE_EVERY = 16

PRIOR_RATE = 0.7
"""Acceptance rate assumed before anything is measured."""


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verification pass yields on average from k drafts at per-token acceptance `rate`."""
    a = min(max(rate, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass(slots=True)
class AcceptancePrior:
    """The engine's recent acceptance rate: an EMA over verified drafts of all requests."""

    rate: float = PRIOR_RATE
    weight_per_token: float = 0.02
    """EMA weight of one verified draft token (a half-life of ~35 draft tokens)."""

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        w = min(1.0, self.weight_per_token * num_drafted)
        self.rate = (1 - w) * self.rate + w * (num_accepted / num_drafted)


@dataclass(slots=True)
class AdaptiveK:
    max_k: int
    cost_per_draft_token: float = 0.15
    ema_weight: float = 0.3
    rate: float = PRIOR_RATE
    """Acceptance rate: the prior (AcceptancePrior's) until the request has been measured."""
    num_drafted: int = 0
    num_accepted: int = 0
    start_rate: float | None = None
    """The rate it started from (the prior), for evidence_rate; set at the first update."""

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        if self.start_rate is None:
            self.start_rate = self.rate
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        observed = num_accepted / num_drafted
        self.rate = (1 - self.ema_weight) * self.rate + self.ema_weight * observed

    def evidence_rate(self, prior_tokens: float = 8.0) -> float:
        """Acceptance over all of the request's verified drafts, its starting prior counted as
        `prior_tokens` drafts: steadier than `rate` (an EMA that two rejections pull down by
        half), for decisions that cannot be taken back."""
        start = self.rate if self.start_rate is None else self.start_rate
        return (self.num_accepted + start * prior_tokens) / (self.num_drafted + prior_tokens)

    def best(self, cost_per_draft_token: float | None = None) -> tuple[int, float]:
        """(k, value): the k in [0, max_k] with the most tokens per unit cost, and that value
        relative to plain decoding (1.0 at k = 0)."""
        c = self.cost_per_draft_token if cost_per_draft_token is None else cost_per_draft_token
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            value = expected_tokens(self.rate, k) / (1 + c * k)
            if value > best:
                best_k, best = k, value
        return best_k, best

    def next_k(self, cost_per_draft_token: float | None = None, probe: bool = False) -> int:
        """k for the next step; `cost_per_draft_token` is the engine's measured price (None: the
        prior); `probe`: this is the engine's probe step, so a request at k = 0 drafts one token."""
        best_k, _ = self.best(cost_per_draft_token)
        if best_k == 0 and probe:
            return min(1, self.max_k)
        return best_k
