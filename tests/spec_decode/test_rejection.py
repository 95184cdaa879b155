"""Exactness of the rejection sampler, checked statistically on a small vocabulary."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from common.spec_decode.adaptive import AdaptiveK
from common.spec_decode.rejection import verify

P = torch.tensor([0.05, 0.4, 0.1, 0.2, 0.25])  # target
Q = torch.tensor([0.5, 0.05, 0.3, 0.1, 0.05])  # draft: very different


def _first_tokens(draft_probs: torch.Tensor | None, trials: int, point: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(P))
    target = torch.stack([P, P])  # [k + 1, vocab] with k = 1
    for _ in range(trials):
        if point is None:
            x = int(torch.multinomial(Q, 1, generator=g))
        else:
            x = point
        out = verify([x], target, draft_probs, greedy=False, generator=g)
        counts[out.token_ids[0]] += 1
    return counts


def test_first_token_follows_target_not_draft():
    trials = 20000
    counts = _first_tokens(Q[None, :], trials)
    assert chisquare(counts.numpy(), (P * trials).numpy()).pvalue > 1e-4
    assert chisquare(counts.numpy(), (Q * trials).numpy()).pvalue < 1e-12


def test_point_mass_proposal_is_exact():
    trials = 20000
    counts = _first_tokens(None, trials, point=0)  # always proposes token 0, like n-gram lookup
    assert chisquare(counts.numpy(), (P * trials).numpy()).pvalue > 1e-4


def test_greedy_accepts_matching_prefix_then_argmax():
    target = torch.zeros(4, 5)
    target[0, 1] = target[1, 3] = target[2, 2] = target[3, 4] = 1.0
    assert verify([1, 3, 0], target, None, greedy=True, generator=None).token_ids == [1, 3, 2]
    assert verify([1, 3, 2], target, None, greedy=True, generator=None).token_ids == [1, 3, 2, 4]
    assert verify([0], target[:2], None, greedy=True, generator=None).token_ids == [1]


def test_adaptive_k_backs_off_and_probes():
    a = AdaptiveK(max_k=5)
    assert a.next_k() > 0
    for _ in range(20):
        a.update(4, 0)
    ks = [a.next_k(probe=i % 16 == 15) for i in range(40)]
    assert ks == [1 if i % 16 == 15 else 0 for i in range(40)]  # off, probing when the engine says
    for _ in range(20):
        a.update(4, 4)
    assert a.next_k() == 5
