"""One `tandem up`-style cluster for the fault tests: 1 prefill, 2 decode, 1 draft, gateway and
its warm standby, its own Redis (the redis-down fault stops it), healing on with a short backoff.
The tests break it on purpose and wait (generously) until the healer has made it whole again.
Secure, like every test cluster (API key, mTLS; tests/cluster/cluster_helpers.py): restarted
services and a promoted standby must come back into an mTLS cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.cluster import Cluster
from services.launcher.healing import RestartPolicy
from tests.cluster.cluster_helpers import ENGINE_ARGS, PINNED_K, start_secure_cluster, wait_for
from tests.faults.fault_table import standby_ready

# --stall-timeout 1: a frozen worker is asked about quickly. Its streams move only when it gives
# no SERVING answer in --stall-probe-timeout (generous: tokens are still taken meanwhile, and a
# live worker on a loaded machine answers well within it and keeps its streams).
STALL_PROBE_TIMEOUT_S = 10.0
FAULT_ARGS: tuple[str, ...] = (*ENGINE_ARGS, *PINNED_K, "--stall-timeout", "1",
                               "--stall-probe-timeout", str(STALL_PROBE_TIMEOUT_S), "--drain-timeout", "10")


@pytest.fixture(scope="package")
def fault_cluster(tiny_model, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, draft_model=str(tiny_model), num_prefill=1, num_decode=2, http_port=0, grpc_port=0,
        redis_url=None, extra_args=FAULT_ARGS, run_dir=str(tmp_path_factory.mktemp("faults")),
        restart=RestartPolicy(limit=10, backoff_s=0.2, backoff_max_s=2.0), startup_timeout_s=600.0,
        standby_gateway=True,  # as `tandem up` does by default
        grace_s=60.0,  # cluster.kill(..., SIGTERM) waits this long for the drain (a loaded machine)
    ) as cluster:  # fmt: skip
        # The standby's start-up (imports, tokenizer) is a burst of CPU: let it pass before the tests.
        wait_for(lambda: standby_ready(cluster), timeout_s=600, what="the standby gateway ready")
        yield cluster


LOG_TAIL_LINES = 60


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed fault test shows the tail of every service's log: CI keeps nothing else, and a
    race seen once there (which worker failed the request, and why) is read from these lines."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("fault_cluster")
    if report.when != "call" or not report.failed or cluster is None:
        return
    for process in cluster.processes:
        path = process.log_path
        if path is None or not Path(path).exists():
            continue
        lines = Path(path).read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        report.sections.append((f"log of {process.name} (last {len(lines)} lines)", "\n".join(lines)))
