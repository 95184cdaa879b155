"""A cluster's stop signals each child once, also the children the healer's thread started.

Children die with the launcher through PR_SET_PDEATHSIG, which Linux ties to the *thread* that
forked them: a worker restarted by the healer got a SIGTERM when the healer's thread ended, and
another from stop_all, which could land while it was exiting (a standby then ended -15, not 0).
Now the children are stopped before the healer's thread ends. Small real child processes that
log every SIGTERM; a real healer thread restarts one of them."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from services.launcher.cluster import Cluster, ClusterSpec
from services.launcher.healing import Healer, RestartPolicy
from services.launcher.supervisor import ServiceProcess, Supervisor
from tests.cluster.cluster_helpers import wait_for

# Logs each SIGTERM; exits 0 one second after the first (time for a second one to be logged).
CHILD = """
import signal, sys, time
terms = []
def term(*_):
    terms.append(time.monotonic())
    with open(sys.argv[1], "a") as log:
        log.write("TERM\\n")
signal.signal(signal.SIGTERM, term)
with open(sys.argv[1], "a") as log:
    log.write("READY\\n")
while not terms or time.monotonic() - terms[0] < 1.0:
    time.sleep(0.02)
"""


def test_a_child_the_healer_restarted_gets_one_sigterm_at_stop(tiny_model: Path, tmp_path: Path) -> None:
    log = tmp_path / "terms.log"
    child = ServiceProcess(role="decode", index=0, argv=[sys.executable, "-c", CHILD, str(log)],
                           log_path=tmp_path / "decode-0.log", grpc_address="127.0.0.1:1")  # fmt: skip
    supervisor = Supervisor(grace_s=30.0)
    supervisor.start(child)
    cluster = Cluster(spec=ClusterSpec(model=str(tiny_model), mode="aggregated"), supervisor=supervisor,
                      redis_url="redis://127.0.0.1:1/0", run_dir=tmp_path)  # fmt: skip
    cluster.healer = Healer(supervisor, RestartPolicy(limit=3, backoff_s=0.05, backoff_max_s=0.1)).start()
    try:
        wait_for(lambda: log.exists() and "READY" in log.read_text(), 600, 0.02, what="the first child up")
        first = child.pid
        child.signal(signal.SIGKILL)
        wait_for(lambda: child.restarts == 1 and log.exists() and log.read_text().count("READY") == 2,
                 600, 0.02,
                 what="the healer's restart, up with its handler")  # fmt: skip
        assert child.pid != first and child.is_running  # started by the healer's thread
    finally:
        codes = cluster.stop()
    assert codes == {"decode-0": 0}
    assert log.read_text().count("TERM") == 1
