"""The healer of `tandem up` on real child processes: a killed child comes back with the same
argv, a crash loop stops at --restart-limit, and the launcher record says what happened."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from services.launcher.healing import Healer, RestartPolicy
from services.launcher.supervisor import ServiceProcess, Supervisor
from services.runtime.status import launcher_line, render_status


def _child(tmp_path: Path, name: str, code: str) -> ServiceProcess:
    return ServiceProcess(role=name, index=0, argv=[sys.executable, "-c", code],
                          log_path=tmp_path / f"{name}.log", grpc_address="127.0.0.1:1")  # fmt: skip


def _heal_until(healer: Healer, predicate, timeout_s: float = 60.0) -> list:
    """Runs healer passes until predicate(events so far) holds (generous bound: a loaded machine)."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events += healer.check()
        if predicate(events):
            return events
        time.sleep(0.02)
    raise AssertionError(f"healer did not get there: {[e.message for e in events]}")


def test_a_killed_child_is_restarted_with_backoff(tmp_path) -> None:
    supervisor = Supervisor(grace_s=5.0)
    child = supervisor.start(_child(tmp_path, "decode", "import time; time.sleep(120)"))
    healer = Healer(supervisor, RestartPolicy(limit=3, backoff_s=0.05, backoff_max_s=0.2))
    try:
        first_pid = child.pid
        assert healer.check() == []  # alive: nothing to do
        child.signal(signal.SIGKILL)
        events = _heal_until(healer, lambda ev: any(e.kind == "restarted" for e in ev))
        assert [e.kind for e in events] == ["exited", "restarted"]
        assert "restarting it in" in events[0].message and "decode-0 exited with code -9" in events[0].message
        assert child.is_running and child.pid != first_pid and child.restarts == 1 and child.exits == [-9]
        doc = healer.launcher_doc()
        assert doc["services"]["decode-0"] == {"role": "decode", "pid": child.pid, "state": "running",
                                               "restarts": 1, "exit_codes": [-9], "grpc_address": "127.0.0.1:1"}
        assert "decode-0 restarted 1x (exit codes -9)" in launcher_line(doc)
    finally:
        supervisor.stop_all(grace_s=5.0)
    assert healer.check() == []  # stopping: the healer leaves stopped children alone


def test_a_crash_loop_stops_at_the_restart_limit(tmp_path) -> None:
    supervisor = Supervisor(grace_s=5.0)
    child = supervisor.start(_child(tmp_path, "prefill", "raise SystemExit(3)"))
    healer = Healer(supervisor, RestartPolicy(limit=2, backoff_s=0.01, backoff_max_s=0.04))
    try:
        events = _heal_until(healer, lambda ev: any(e.kind == "gave_up" for e in ev))
        assert [e.kind for e in events] == ["exited", "restarted", "exited", "restarted", "gave_up"]
        assert "--restart-limit 2" in events[-1].message
        assert healer.gave_up is child and child.restarts == 2 and child.exits == [3, 3, 3]
        assert healer.check() == []  # given up: left down
        doc = healer.launcher_doc()
        assert doc["services"]["prefill-0"]["state"] == "gave_up"
        text = render_status([], as_json=False, launcher=doc)
        assert "prefill-0 restarted 2x (exit codes 3 3 3), gave up" in text
    finally:
        supervisor.stop_all(grace_s=5.0)


def test_backoff_doubles_and_is_capped() -> None:
    policy = RestartPolicy(limit=9, backoff_s=0.5, backoff_max_s=3.0)
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="limit"):
        RestartPolicy(limit=-1)
