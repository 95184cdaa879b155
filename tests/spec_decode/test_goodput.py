"""The goodput governor: drafting stops where drafting steps deliver less than plain steps."""

from __future__ import annotations

from common.spec_decode.goodput import GoodputGovernor


def _decisions(g: GoodputGovernor, n: int) -> list[bool]:
    return [g.allow() for _ in range(n)]


def test_measures_both_kinds_first():
    g = GoodputGovernor()
    first = _decisions(g, 8)
    assert first.count(False) == 2 and g.drafting_pays is None  # plain steps asked for, to measure
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.1)
    assert all(_decisions(g, 8)) and g.drafting_pays is None  # plain measured; drafting not yet


def test_stops_drafting_that_delivers_less_and_keeps_probing():
    g = GoodputGovernor(probe_every=8)
    for _ in range(3):
        g.observe(drafted=False, tokens=4, sequences=4, seconds=0.10)  # 10 tok/s per sequence
        g.observe(drafted=True, tokens=8, sequences=4, seconds=0.25)  # 8 tok/s per sequence
    assert g.drafting_pays is False
    assert _decisions(g, 32).count(True) == 4  # one probe in 8 drafts anyway


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
