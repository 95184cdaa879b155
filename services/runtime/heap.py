"""A long-running service's Python heap: start-up's objects frozen out of garbage collection, and
every collection's pause timed for /metrics (`tandem_gc_pause_seconds{generation}`).

Why: CPython's full (generation 2) collection walks every tracked object, and a started service
holds a few hundred thousand that live as long as it does (modules, the model's tensors, the
tokenizer, protobuf descriptors: 260 thousand in the decode worker, 410 thousand in the gateway).
A full collection then stops the whole process (the decode worker's engine thread and event loop,
every stream of the gateway) for 130-180 ms; the decode worker's background tokenizer load set off
three of them, the gateway one, around start-up (tiny model, 2026-12-07). Frozen (`gc.freeze`),
those objects are skipped: a collection walks only what was made since. Measured from readiness
(benchmarks/gc_pauses.py, 4 streams x 60 s, no full collection in either arm): the decode
worker's largest pause 5 ms -> 1 ms, the gateway's 2.5 -> 1-2.5 ms (10-25 ms unfrozen in earlier
runs); the client's TTFT and token gaps were level.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

# TANDEM_GC_FREEZE=0 leaves the heap as CPython has it: the before of benchmarks/gc_pauses.py, and a
# way to rule the freeze out when a service's memory grows (frozen objects are never collected as
# cycles; they are still freed by reference counting).
FREEZE_ENV = "TANDEM_GC_FREEZE"
PAUSE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


def freeze_long_lived() -> bool:
    """Collects once, then moves every object tracked now out of later collections. Called when a
    service is up (and again after work it does in the background at start, such as loading a
    tokenizer). False where TANDEM_GC_FREEZE=0."""
    if os.environ.get(FREEZE_ENV, "1").strip() == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


def freeze_again() -> bool:
    """After start-up work done in the background (the decode worker's tokenizer: ~2 s of imports,
    a hundred thousand objects), freezes that too; nothing where the process never froze (a service
    run inside a test process, whose heap is the test runner's)."""
    return gc.get_freeze_count() > 0 and freeze_long_lived()


class GcPauses:
    """Counts of collection pauses by generation and bucket, kept by a gc callback. The callback
    does integer and float arithmetic on lists made up front, nothing that allocates a tracked
    object or takes a lock: it runs inside whatever allocation set the collection off, on any
    thread, possibly while that thread holds a lock of prometheus_client's."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.buckets = [[0] * (len(PAUSE_BUCKETS) + 1) for _ in GENERATIONS]  # the last: +Inf
        self.sums = [0.0 for _ in GENERATIONS]
        self._started = [0.0]

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started[0] = self.clock()
            return
        seconds = self.clock() - self._started[0]
        generation = info["generation"]
        row = self.buckets[generation]
        i = 0
        while i < len(PAUSE_BUCKETS) and seconds > PAUSE_BUCKETS[i]:
            i += 1
        row[i] += 1
        self.sums[generation] += seconds

    def families(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("tandem_gc_pause_seconds", "Garbage-collection pauses of this process, "
                                       "by generation.", labels=["generation"])  # fmt: skip
        for generation in GENERATIONS:
            counts, running = [], 0
            for bound, n in zip((*PAUSE_BUCKETS, float("inf")), self.buckets[generation]):
                running += n
                counts.append((str(bound) if bound != float("inf") else "+Inf", running))
            family.add_metric([str(generation)], counts, self.sums[generation])
        yield family


_pauses: GcPauses | None = None


def process_gc_pauses() -> GcPauses:
    """This process's pause counts, its gc callback installed on first use (once per process)."""
    global _pauses
    if _pauses is None:
        _pauses = GcPauses()
        gc.callbacks.append(_pauses.callback)
    return _pauses


class GcPauseCollector(Collector):
    """The process's pauses on a registry (each ServiceMetrics has one; services in one test process
    share the process's counts, as they share its collector)."""

    def __init__(self) -> None:
        self.pauses = process_gc_pauses()  # counting from now, not from the first scrape

    def collect(self) -> Iterator[HistogramMetricFamily]:
        return self.pauses.families()
