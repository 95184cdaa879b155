"""services/runtime/heap.py: the start-up freeze and the garbage-collection pause histogram."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.runtime import heap


@pytest.fixture
def unfrozen():
    """The test runner's heap as it was: nothing left frozen (frozen objects are never collected)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def samples(pauses: heap.GcPauses) -> dict[tuple[str, str, str], float]:
    """(sample name, generation, le) -> value, as a registry exposes them."""
    registry = CollectorRegistry()
    collector = heap.GcPauseCollector()
    collector.pauses = pauses
    registry.register(collector)
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, s.labels["generation"], s.labels.get("le", ""))] = s.value
    return out


def test_pauses_land_in_their_generation_and_bucket() -> None:
    clock = iter([10.0, 10.0003, 20.0, 20.2, 30.0, 32.0])  # 0.3 ms, 200 ms, 2 s
    pauses = heap.GcPauses(clock=lambda: next(clock))
    for generation in (0, 2, 2):
        pauses.callback("start", {"generation": generation})
        pauses.callback("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    got = samples(pauses)
    assert got[("tandem_gc_pause_seconds_bucket", "0", "0.0005")] == 1
    assert got[("tandem_gc_pause_seconds_count", "0", "")] == 1
    assert got[("tandem_gc_pause_seconds_count", "1", "")] == 0
    assert got[("tandem_gc_pause_seconds_bucket", "2", "0.1")] == 0
    assert got[("tandem_gc_pause_seconds_bucket", "2", "0.25")] == 1  # cumulative buckets
    assert got[("tandem_gc_pause_seconds_bucket", "2", "1.0")] == 1
    assert got[("tandem_gc_pause_seconds_bucket", "2", "+Inf")] == 2  # past the last bound
    assert got[("tandem_gc_pause_seconds_sum", "2", "")] == pytest.approx(2.2)


def test_the_process_callback_counts_real_collections() -> None:
    collector = heap.GcPauseCollector()  # installs the process's callback (once)
    assert gc.callbacks.count(collector.pauses.callback) == 1
    heap.GcPauseCollector()
    assert gc.callbacks.count(collector.pauses.callback) == 1
    before = samples(collector.pauses)[("tandem_gc_pause_seconds_count", "2", "")]
    gc.collect()
    assert samples(collector.pauses)[("tandem_gc_pause_seconds_count", "2", "")] == before + 1


def test_freeze_moves_live_objects_out_of_collections(unfrozen) -> None:
    assert gc.get_freeze_count() == 0
    assert heap.freeze_long_lived()
    frozen = gc.get_freeze_count()
    assert frozen > 0
    kept = [[i] for i in range(1000)]  # made after the freeze: tracked again
    assert heap.freeze_again()  # the process froze before, so it freezes what came since
    assert gc.get_freeze_count() >= frozen + len(kept)


def test_freeze_can_be_turned_off_and_is_never_started_by_freeze_again(unfrozen, monkeypatch) -> None:
    assert not heap.freeze_again()  # never frozen: a service inside a test process leaves the heap alone
    assert gc.get_freeze_count() == 0
    monkeypatch.setenv(heap.FREEZE_ENV, "0")
    assert not heap.freeze_long_lived()
    assert gc.get_freeze_count() == 0
