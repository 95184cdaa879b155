"""benchmarks/serve_ab.py's run order: each side goes first in every other pair, so a machine that
speeds up or slows down over the runs does not favour either side's ratio."""

from __future__ import annotations

from benchmarks.serve_ab import order


def test_each_side_goes_first_in_every_other_pair():
    assert order(3) == ["before", "after", "after", "before", "before", "after"]
    assert order(1) == ["before", "after"]
    runs = order(4)
    assert runs.count("before") == runs.count("after") == 4
    assert [runs[2 * i] for i in range(4)] == ["before", "after", "before", "after"]
