"""The measured price of a draft token, and how adaptive k uses it."""

from __future__ import annotations

import pytest

from common.spec_decode.adaptive import AdaptiveK, expected_tokens
from common.spec_decode.step_cost import StepCostModel


def fed(fixed: float, per_token: float, draft_per_token: float, sizes=(1, 5, 2, 5, 3, 5)) -> StepCostModel:
    m = StepCostModel()
    for n in sizes * 3:
        m.observe_step(n, fixed + per_token * n)
    m.observe_proposal(1, 4, 4 * draft_per_token)
    return m


def test_fits_the_line_and_prices_a_draft_token():
    m = fed(fixed=0.065, per_token=0.005, draft_per_token=0.006)
    fixed, per_token = m.line()
    assert fixed == pytest.approx(0.065, rel=1e-6) and per_token == pytest.approx(0.005, rel=1e-6)
    # batch 1: one sequence's share of a plain step is the whole 70 ms step
    assert m.draft_token_cost(1) == pytest.approx((0.005 + 0.006) / 0.070)
    # batch 16: the share shrinks to (65 + 80) / 16 ms; one call drafts for all 16, so a draft
    # position's 6 ms (calls of one size only: the memory-bound assumption) is shared 16 ways
    assert m.draft_token_cost(16) == pytest.approx((0.005 + 0.006 / 16) / ((0.065 + 0.005 * 16) / 16))


def test_unmeasured_until_two_step_sizes_and_a_proposal():
    m = StepCostModel()
    assert m.draft_token_cost(1) is None
    for _ in range(10):
        m.observe_step(5, 0.09)  # one size only: the slope is unknown
    m.observe_proposal(1, 4, 0.02)
    assert m.line() is None and m.draft_token_cost(1) is None
    m.observe_step(1, 0.07)
    m.observe_step(1, 0.07)
    assert m.draft_token_cost(1) is not None
    assert StepCostModel().draft_token_cost(0) is None


def test_recent_steps_outweigh_old_ones():
    m = fed(fixed=0.05, per_token=0.02, draft_per_token=0.0)
    for n in (1, 5) * 60:  # the machine got faster per token (120 steps on: the old ones weigh ~0.2%)
        m.observe_step(n, 0.05 + 0.002 * n)
    assert m.line()[1] == pytest.approx(0.002, rel=0.05)  # was 0.02


def test_cost_is_clamped_and_slope_never_negative():
    m = StepCostModel()
    for n in (1, 9) * 5:
        m.observe_step(n, 0.1 - 0.001 * n)  # noise can make bigger steps look cheaper
    m.observe_proposal(1, 1, 100.0)
    assert m.line()[1] == 0.0
    assert m.draft_token_cost(1) == m.max_cost


def test_a_draft_position_is_priced_by_the_sequences_it_drafts_for():
    m = fed(fixed=0.065, per_token=0.005, draft_per_token=0.006)
    for _ in range(4):  # calls for 4 sequences: a position now costs 9 ms (6 + 1 per sequence)
        m.observe_proposal(4, 3, 3 * 0.009)
        m.observe_proposal(1, 3, 3 * 0.006)
    assert m.draft_s_per_position(1) == pytest.approx(0.005, abs=2e-3)
    assert m.draft_s_per_position(16) == pytest.approx(0.005 + 0.001 * 16, rel=0.1)
    assert m.draft_token_cost(4) == pytest.approx((0.005 + m.draft_s_per_position(4) / 4) / ((0.065 + 0.02) / 4))


def test_a_catch_up_is_priced_per_ingested_token_net_of_drafting():
    m = fed(fixed=0.065, per_token=0.005, draft_per_token=0.006)
    assert m.ingest_cost(100) == pytest.approx(100 * 0.005)  # unmeasured: the target's per-token price
    m.observe_catch_up(200, 1, 4, 4 * 0.006 + 200 * 0.002)  # 200 prompt tokens at 2 ms, then 4 drafts
    assert m.ingest_s_per_token == pytest.approx(0.002)
    assert m.ingest_cost(50) == pytest.approx(0.1)
    assert StepCostModel().ingest_cost(10) is None


def test_adaptive_k_follows_the_measured_cost():
    good = AdaptiveK(max_k=4, rate=0.75)
    assert good.next_k(0.05) == 4  # cheap drafts (GPU, or the CPU kernel at batch 1): go long
    assert good.next_k(2.0) == 0  # a compute-bound batch where a draft token costs 2 steps' share
    assert good.next_k() == good.next_k(good.cost_per_draft_token)  # None means the prior
    assert good.best(2.0) == (0, 1.0) and good.best(0.05)[1] > 2.5  # and what it is worth
    weak = AdaptiveK(max_k=4, rate=0.3)
    assert weak.next_k(0.05) > 0 and weak.next_k(0.6) == 0


def test_asks_for_a_plain_step_while_the_slope_is_unknown():
    m = StepCostModel(explore_every=4)
    assert not any(m.should_explore() for _ in range(10))  # nothing measured yet: nothing to fix
    for _ in range(5):
        m.observe_step(20, 0.3)  # every request drafting the same k: one step size
    asks = [m.should_explore() for _ in range(9)]
    assert asks == [True] + [False, False, False, True] * 2  # at once, then one step in 4
    m.observe_step(4, 0.1)  # the plain step it asked for
    m.observe_step(4, 0.1)
    assert m.line() is not None and not any(m.should_explore() for _ in range(10))


def test_acceptance_prior_follows_recent_drafts():
    from common.spec_decode.adaptive import PRIOR_RATE, AcceptancePrior

    prior = AcceptancePrior()
    assert prior.rate == PRIOR_RATE
    for _ in range(50):
        prior.update(4, 0)
    assert prior.rate < 0.02
    prior.update(0, 0)  # nothing verified: no change
    for _ in range(50):
        prior.update(4, 4)
    assert prior.rate > 0.98



def test_the_line_stands_through_a_long_run_of_one_step_size():
    m = fed(fixed=0.065, per_token=0.005, draft_per_token=0.006)
    for _ in range(200):  # plain decoding at one batch size: the spread decays away
        m.observe_step(4, 0.085)
    assert m.target.fit() is None
    assert m.line() == pytest.approx((0.065, 0.005), rel=0.05) and not m.should_explore()


def test_a_drafting_steps_time_over_a_plain_steps():
    m = fed(fixed=0.065, per_token=0.005, draft_per_token=0.006)
    plain = 0.065 + 0.005 * 4
    # batch 4, three sequences drafting 3, 2 and 0 tokens: 5 more tokens scored, 3 draft positions
    assert m.step_ratio(4, [3, 2, 0]) == pytest.approx((plain + 0.005 * 5 + 0.006 * 3) / plain)
    assert m.step_ratio(4, []) == pytest.approx(1.0)
    assert StepCostModel().step_ratio(4, [2]) is None  # unmeasured


def test_expected_tokens_of_a_verification_pass():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 0) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 3) == pytest.approx(4.0, rel=1e-2)


def test_evidence_rate_counts_every_verified_draft_with_the_prior_as_eight():
    k = AdaptiveK(4, rate=0.9)
    assert k.evidence_rate() == pytest.approx(0.9)  # nothing verified yet: the prior
    k.update(4, 4)
    k.update(4, 0)
    k.update(4, 0)  # two rejected rounds: the EMA halves, the evidence barely moves
    assert k.rate < 0.5
    assert k.evidence_rate() == pytest.approx((4 + 0.9 * 8) / (12 + 8))
    for _ in range(20):  # a request that really accepts little ends up there
        k.update(4, 1)
    assert k.evidence_rate() == pytest.approx((24 + 7.2) / (92 + 8))
