"""The goodput governor: drafting stops where drafting steps deliver less than plain steps."""

from __future__ import annotations

import pytest

from common.spec_decode.goodput import GoodputGovernor, GovernorsByBatch


def _decisions(g: GoodputGovernor, n: int) -> list[bool]:
    return [g.allow() for _ in range(n)]


def test_measures_both_kinds_first():
    g = GoodputGovernor()
    first = _decisions(g, 8)
    assert first.count(False) == 2 and g.drafting_pays is None  # plain steps asked for, to measure
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.1)
    assert all(_decisions(g, 8)) and g.drafting_pays is None  # plain measured; drafting not yet


def _bursts(decisions: list[bool]) -> list[tuple[int, int]]:
    """(index of the first decision, length) of each run of True."""
    runs, start = [], None
    for i, d in enumerate(decisions + [False]):
        if d and start is None:
            start = i
        elif not d and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def _run(g: GoodputGovernor, n: int, spec_tok_s: float, plain_tok_s: float = 10.0) -> list[bool]:
    """n engine steps at batch 4: each drafts when allowed, at these tokens/s per sequence."""
    decisions = []
    for _ in range(n):
        drafted = g.allow()
        decisions.append(drafted)
        rate = spec_tok_s if drafted else plain_tok_s
        g.observe(drafted=drafted, tokens=4, sequences=4, seconds=1.0 / rate)
    return decisions


def test_stops_drafting_that_delivers_less_and_probes_in_bursts_that_back_off():
    g = GoodputGovernor(probe_every=8, burst_wait=8, max_burst_wait=32, probe_len=3)
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.10)  # 10 tok/s per sequence
        g.observe(drafted=True, tokens=8, sequences=4, seconds=0.25)  # 8 tok/s per sequence
    assert g.drafting_pays is False
    bursts = _bursts(_run(g, 200, spec_tok_s=8.0))
    assert all(length == 3 for _, length in bursts)  # a burst measures a few steps, not one
    gaps = [b[0] - a[0] - a[1] for a, b in zip(bursts, bursts[1:])]
    assert gaps[:3] == [15, 31, 31]  # the wait doubles (8, 16, 32 decisions) up to the cap
    # Drafting pays again (found by a burst): back to drafting, and the wait starts over.
    for _ in range(10):
        g.observe(drafted=True, tokens=16, sequences=4, seconds=0.2)  # 20 tok/s per sequence
    assert g.drafting_pays is True and _run(g, 16, spec_tok_s=20.0).count(False) == 2
    for _ in range(10):
        g.observe(drafted=True, tokens=4, sequences=4, seconds=0.2)
    assert g.drafting_pays is False
    assert _bursts(_run(g, 40, spec_tok_s=8.0))[0][0] == 7  # the first burst after burst_wait again


def test_a_burst_waits_for_a_step_that_drafts():
    """Allowed to draft but nobody drafted (no new request to probe with): the burst stays due."""
    g = GoodputGovernor(burst_wait=4, probe_len=2)
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.10)
        g.observe(drafted=True, tokens=8, sequences=4, seconds=0.25)
    assert _decisions(g, 4) == [False, False, False, True]
    assert all(_decisions(g, 10))  # still due: no drafting step was observed
    g.observe(drafted=True, tokens=8, sequences=4, seconds=0.25)
    assert g.allow() is True  # the burst's second step
    g.observe(drafted=True, tokens=8, sequences=4, seconds=0.25)
    assert g.allow() is False  # done; the next burst waits 8 decisions


def test_a_gain_that_no_drafting_step_refreshes_goes_stale_and_a_burst_explores():
    """Drafting pays by the last measurement, but no step drafts (the engine's start check, which
    rests on the last workload's acceptance, refuses every new request): a burst comes due after
    burst_wait decisions and stays due (`exploring`) until drafting steps are seen; the wait
    doubles while nothing drafts of its own accord and starts over once something does."""
    g = GoodputGovernor(probe_every=1000, burst_wait=8, max_burst_wait=32, probe_len=2)
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.10)
        g.observe(drafted=True, tokens=12, sequences=4, seconds=0.15)
    assert g.drafting_pays is True and not g.exploring
    assert all(_decisions(g, 7)) and not g.exploring  # allowed, but nothing drafted
    assert g.allow() and g.exploring  # stale: a burst is due
    assert all(_decisions(g, 5)) and g.exploring  # and stays due until a step drafts
    for _ in range(2):
        g.observe(drafted=True, tokens=12, sequences=4, seconds=0.15)
    assert not g.exploring
    assert all(_decisions(g, 15)) and not g.exploring and g.allow() and g.exploring  # waited 16
    for _ in range(3):
        g.observe(drafted=True, tokens=12, sequences=4, seconds=0.15)  # the burst, then one of its own
    assert all(_decisions(g, 7)) and g.allow() and g.exploring  # back to burst_wait


def test_keeps_drafting_that_pays_with_an_occasional_plain_step():
    g = GoodputGovernor(probe_every=8)
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.10)
        g.observe(drafted=True, tokens=12, sequences=4, seconds=0.15)  # 20 tok/s per sequence
    assert g.drafting_pays is True
    assert _decisions(g, 32).count(False) == 4
    # Acceptance falls: the moving average follows and drafting stops.
    for _ in range(20):
        g.observe(drafted=True, tokens=4, sequences=4, seconds=0.2)
    assert g.drafting_pays is False


def test_each_batch_size_class_has_its_own_governor():
    governors = GovernorsByBatch()
    assert governors.for_batch(1) is governors.for_batch(1)
    assert governors.for_batch(4) is governors.for_batch(7) is not governors.for_batch(8)
    assert governors.for_batch(2) is not governors.for_batch(1) and governors.for_batch(0) is governors.for_batch(1)
    g1, g16 = governors.for_batch(1), governors.for_batch(16)
    for _ in range(3):
        g1.observe(drafted=False, tokens=1, sequences=1, seconds=0.25)  # 4 tok/s
        g1.observe(drafted=True, tokens=3, sequences=1, seconds=0.5)  # 6 tok/s: pays at batch 1
        g16.observe(drafted=False, tokens=16, sequences=16, seconds=0.7)
        g16.observe(drafted=True, tokens=48, sequences=16, seconds=3.0)  # a loss at 16
    assert g1.drafting_pays is True and g16.drafting_pays is False


def test_calibration_scales_predictions_by_what_drafting_delivered():
    g = GoodputGovernor(min_samples=1)
    assert g.calibrated(1.3) == 1.3  # nothing measured: the prediction as it is
    g.observe(False, 4, 4, 0.2)  # plain: 5 tokens/s per sequence
    g.observe(True, 8, 4, 0.5, predicted=1.25)  # drafting: 4/s, where 1.25x (6.25/s) was expected
    assert g.calibrated(1.25) == pytest.approx(0.8)
    assert g.calibrated(2.5) == pytest.approx(1.6)  # a higher prediction (acceptance rose) may start again
