"""Statistical checks: sampled frequencies follow the distribution compute_probs returns.

Each test draws ~20k tokens from an 8-token vocabulary and runs a chi-square goodness-of-fit test.
Everything is seeded, so the p-values are fixed numbers, not flaky; the thresholds are far from
them in both directions (a correct sampler passes at p > 0.001, a wrong target fails at < 1e-6).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from scipy.stats import chisquare

from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler

torch.set_num_threads(1)

VOCAB = 8
DRAWS = 20_000
LOGITS = torch.tensor([1.2, -0.3, 0.8, 2.0, -1.5, 0.1, 0.5, -0.7])


def _counts(params: SamplingParams, seeded: bool = False) -> np.ndarray:
    """Draws DRAWS tokens as one batch of DRAWS identical rows (or DRAWS seeded requests)."""
    sampler = Sampler(seed=1234)
    if seeded:
        states = [sampler.new_state(replace(params, seed=10_000 + i), []) for i in range(DRAWS)]
    else:
        states = [sampler.new_state(params, []) for _ in range(DRAWS)]
    tokens = sampler.sample(LOGITS.expand(DRAWS, VOCAB), states).token_ids
    return np.bincount(tokens, minlength=VOCAB)


def _pvalue(counts: np.ndarray, probs: torch.Tensor) -> float:
    """Chi-square over the tokens with nonzero expected probability; zero-prob tokens must be 0."""
    probs64 = probs.double().numpy()
    support = probs64 > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = probs64[support] / probs64[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


def _renorm(p: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


def test_temperature_sampling_matches_softmax() -> None:
    for temperature in (1.0, 0.6, 1.7):
        params = SamplingParams(temperature=temperature)
        counts = _counts(params)
        target = torch.softmax(LOGITS / temperature, -1)
        assert _pvalue(counts, target) > 1e-3, (temperature, counts)
        # The sampler's own compute_probs is that same distribution.
        sampler = Sampler()
        probs = sampler.compute_probs(LOGITS.unsqueeze(0), [sampler.new_state(params, [])])[0]
        assert torch.allclose(probs, target, atol=1e-6)


def test_seeded_rows_match_softmax() -> None:
    counts = _counts(SamplingParams(temperature=0.8), seeded=True)
    assert _pvalue(counts, torch.softmax(LOGITS / 0.8, -1)) > 1e-3


def test_top_k_and_top_p_renormalised() -> None:
    p = torch.softmax(LOGITS, -1)  # order: 3 (.431), 0 (.194), 2 (.130), 6 (.096), ...
    counts = _counts(SamplingParams(top_k=3))
    assert _pvalue(counts, _renorm(p, [3, 0, 2])) > 1e-3
    counts = _counts(SamplingParams(top_p=0.7))  # masses above: 0, .431, .625, .755 -> 3 kept
    assert _pvalue(counts, _renorm(p, [3, 0, 2])) > 1e-3
    sampler = Sampler()
    combined = SamplingParams(top_k=4, temperature=0.7, top_p=0.9, min_p=0.1)
    probs = sampler.compute_probs(LOGITS.unsqueeze(0), [sampler.new_state(combined, [])])[0]
    assert int((probs > 0).sum()) < 4
    counts = _counts(combined)
    assert _pvalue(counts, probs) > 1e-3


def test_chi_square_rejects_wrong_distribution() -> None:
    counts = _counts(SamplingParams(temperature=1.0))
    assert _pvalue(counts, torch.softmax(LOGITS / 1.2, -1)) < 1e-6
    assert _pvalue(counts, torch.softmax(LOGITS.flip(0), -1)) < 1e-6
    swapped = torch.softmax(LOGITS, -1)[[0, 1, 6, 3, 4, 5, 2, 7]]  # swap .130 and .096
    assert _pvalue(counts, swapped) < 1e-6
    # Not renormalising after top_k (the untruncated softmax) is caught too.
    counts = _counts(SamplingParams(top_k=3))
    p = torch.softmax(LOGITS, -1)
    wrong = torch.zeros_like(p)
    wrong[[3, 0, 2]] = p[[3, 0, 2]]
    wrong[3] += 1 - wrong.sum()  # leftover mass piled on the top token
    assert _pvalue(counts, wrong) < 1e-6
