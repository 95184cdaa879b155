"""Acceptance 1 of issue 11, reduced for `make test`: the fault table (tests/faults/fault_table.py)
with 4 clients x 5 requests per fault, a 14 s freeze (past the stall
check's 1 + 10 s, so its streams migrate) and a 3 s Redis outage. The full table
(8 x 40, 30 s freeze, 20 s outage) is `benchmarks/faults.py`.

Asserted: no failed request for any worker fault, only in-flight requests lost on a gateway
kill (where the warm standby takes over), greedy outputs equal to the fault-free run, every
worker's KV back to idle after the last request, and the cluster whole again after each fault.
How fast is reported, never asserted."""

from __future__ import annotations

from services.launcher.cluster import Cluster
from tests.faults.fault_table import WORKER_FAULTS, Load, format_table, run_table

LOAD = Load(clients=4, requests_per_client=5, max_tokens=24, freeze_s=14.0, redis_down_s=3.0)


def test_fault_table(fault_cluster: Cluster) -> None:
    results = run_table(fault_cluster, LOAD)
    print("\n" + format_table(results))
    by_fault = {r.fault: r for r in results}
    for r in results:
        assert r.requests == LOAD.num_requests, r
        assert r.mismatched == 0, r
        assert r.kv_baseline_s is not None, f"{r.fault}: KV did not return to idle: {r}"
        assert r.healed_s is not None, f"{r.fault}: cluster not whole again: {r}"
    for fault in ("none", *WORKER_FAULTS):
        r = by_fault[fault]
        assert r.failed == 0 and r.lost_in_flight == 0 and r.ok == LOAD.num_requests, r
    gateway = by_fault["sigkill-gateway"]
    assert gateway.failed == 0 and gateway.lost_in_flight <= LOAD.clients, gateway  # only what was in flight
    assert gateway.lost_after_gone == 0, gateway  # none sent after the dead gateway's sockets closed
    assert gateway.restarts.get("gateway-0") == 1, gateway
    assert gateway.standby_takeovers == 1, gateway  # the warm standby took over (conftest keeps one)
    assert all(r.standby_takeovers == 0 for r in results if r.fault != "sigkill-gateway"), results
    assert by_fault["sigkill-decode"].restarts.get("decode-0") == 1
