"""The warm standby gateway of `tandem up` (services/launcher/standby.py), on real processes.

A real cluster: SIGKILL the gateway twice; each time the process that serves afterwards is the
standby that had said READY before the kill (so no start-up was paid after it), on the gateway's
own ports, with the same greedy tokens, and `tandem status` says so. Then the healer's rules with
a standby, on small child processes that speak the standby protocol: a promoted gateway that
crash-loops still backs off and is given up on at the limit; a standby that keeps dying is
given up on and the gateway falls back to cold restarts."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.healing import Healer, HealEvent, RestartPolicy
from services.launcher.standby import Standby
from services.launcher.supervisor import ServiceProcess, Supervisor
from services.runtime.registry import Registry
from services.runtime.status import launcher_line
from tests.cluster.cluster_helpers import (
    ENGINE_ARGS,
    complete_ids,
    gateway_channel,
    random_prompts,
    rest,
    start_secure_cluster,
    wait_for,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
PATIENT_S = 600.0  # bounds for a loaded machine; nothing here asserts how fast


def _tcp_sockets(port: int, state: str) -> list[str]:
    """Inodes of the TCP sockets whose local end is `port`, in `state` (/proc/net/tcp's hex code:
    0A LISTEN, 01 ESTABLISHED); Linux."""
    inodes = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for row in list(fh)[1:]:
                cols = row.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == state:
                    inodes.append(cols[9])
    return inodes


def _listening_pids(port: int) -> set[int]:
    """The processes that hold a listening TCP socket on `port` (from /proc, Linux)."""
    inodes = {f"socket:[{inode}]" for inode in _tcp_sockets(port, "0A")}
    pids = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                pids.add(int(pid))
        except OSError:  # gone, or not ours
            continue
    return pids


def _server_connections(port: int) -> int:
    """Established TCP connections whose local end is `port`: the server's side, accepted or still
    waiting in the listening socket's backlog."""
    return len(_tcp_sockets(port, "01"))


def _sent_while_frozen_then_killed(cluster, http_port: int, prompt: list[int]) -> list[int]:
    """A request that connects while the gateway is frozen (SIGSTOP: the kernel queues it in the
    REST socket's backlog, nobody accepts it), then the gateway is SIGKILLed. The socket is the
    launcher's, so the connection waits there for the standby. (Before, each gateway bound its own
    socket and the kill reset every connection in its backlog: the request was lost.)"""
    result: dict[str, object] = {}
    before = _server_connections(http_port)
    cluster.gateway.signal(signal.SIGSTOP)
    try:
        def send() -> None:
            try:
                result["tokens"] = complete_ids(cluster, prompt)
            except Exception as e:  # reported by the assertion below
                result["error"] = e

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        wait_for(lambda: _server_connections(http_port) > before, PATIENT_S, 0.01, what="the request's connection queued")
    finally:
        cluster.kill("gateway")  # SIGKILL ends a stopped process too
    sender.join(PATIENT_S)
    assert "error" not in result, f"the queued request was lost with the gateway: {result['error']!r}"
    return result["tokens"]  # type: ignore[return-value]


def _complete_through_restart(cluster, prompt: list[int]) -> list[int]:
    """A request sent until the gateway accepts the connection (it is between processes)."""
    deadline = time.monotonic() + PATIENT_S
    while True:
        try:
            return complete_ids(cluster, prompt)
        except httpx.ConnectError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_killed_gateway_is_replaced_by_its_warm_standby(tiny_model, dev_certs, tmp_path) -> None:
    prompt = random_prompts([23], seed=7)[0]
    # Secure like every test cluster (mTLS, API key): the standby serves with the gateway's identity.
    with start_secure_cluster(tiny_model, dev_certs, mode="aggregated", num_decode=1, http_port=0, grpc_port=0,
                              redis_url=None, extra_args=ENGINE_ARGS, run_dir=str(tmp_path),
                              startup_timeout_s=PATIENT_S, standby_gateway=True,
                              restart=RestartPolicy(limit=5, backoff_s=0.2, backoff_max_s=1.0, stable_s=3600.0),
                              ) as cluster:  # fmt: skip
        standby, healer = cluster.standby, cluster.healer
        assert standby is not None and healer is not None
        http_port = int(cluster.http_url.rsplit(":", 1)[1])
        grpc_port = int(cluster.grpc_address.rsplit(":", 1)[1])
        expected = complete_ids(cluster, prompt)
        for kill in (1, 2):
            wait_for(lambda: standby.state == "ready", PATIENT_S, what=f"standby ready before kill {kill}")
            spare_pid, old_pid = standby.spare.pid, cluster.gateway.pid
            # Standing by binds nothing: the gRPC port is the serving gateway's alone; the REST
            # socket is the launcher's (this process), inherited by the gateway and the standby.
            assert _listening_pids(grpc_port) == {old_pid}
            assert _listening_pids(http_port) == {os.getpid(), old_pid, spare_pid}
            # Connections open on both ports when it dies: their server ends linger (TIME_WAIT),
            # which must not keep the standby from binding the same ports.
            with rest(cluster) as keep_alive, gateway_channel(cluster) as channel:
                assert keep_alive.get("/health").status_code == 200
                health = health_pb2_grpc.HealthStub(channel)
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=60).status == SERVING
                if kill == 1:
                    assert _sent_while_frozen_then_killed(cluster, http_port, prompt) == expected
                else:
                    cluster.kill("gateway")
                    assert _complete_through_restart(cluster, prompt) == expected
                assert health.Check(health_pb2.HealthCheckRequest(), timeout=PATIENT_S,
                                    wait_for_ready=True).status == SERVING  # fmt: skip
            # The process serving now is the standby that was READY before the kill.
            assert cluster.gateway.pid == spare_pid != old_pid
            assert _listening_pids(grpc_port) == {spare_pid}
            # The healer records the takeover once its pass ends, which may be after the standby
            # has already served the queued request.
            def promotions() -> list[HealEvent] | None:
                found = [e for e in list(healer.history) if e.kind == "promoted"]  # a copy: it grows
                return found if len(found) >= kill else None

            promoted = wait_for(promotions, PATIENT_S, what=f"takeover {kill} recorded")
            assert len(promoted) == kill and f"is now pid {spare_pid} (the standby was ready" in promoted[-1].message
            assert standby.takeovers == kill == cluster.gateway.restarts and cluster.gateway.exits[-1] == -9
            assert standby.spare is not None and standby.spare.pid not in (spare_pid, old_pid)  # the next one
            held_by = {os.getpid(), spare_pid, standby.spare.pid}  # the next standby inherits it too
            wait_for(lambda: _listening_pids(http_port) == held_by, PATIENT_S, what="the REST socket's holders")
            assert "standby: promoted" in cluster.gateway.log_path.read_text()
        exited = [e.message for e in healer.history if e.kind == "exited"]
        assert "its standby takes over now" in exited[0]  # the first death of a streak: no wait
        assert "its standby takes over in 0.4 s" in exited[1]  # a quick second death backs off
        wait_for(lambda: standby.state == "ready", PATIENT_S, what="third standby ready")
        line = launcher_line(healer.launcher_doc())
        assert "gateway-0 restarted 2x (exit codes -9 -9), 2x by its standby" in line, line
        assert f"gateway-0 standby ready (pid {standby.spare.pid})" in line, line

        def recorded() -> dict | None:
            with Registry(cluster.redis_url, cluster.cluster) as registry:
                doc = registry.get_launcher()
            service = (doc or {}).get("services", {}).get("gateway-0", {})
            return service if service.get("standby") == {"state": "ready", "pid": standby.spare.pid,
                                                         "takeovers": 2} else None  # fmt: skip

        shown = wait_for(recorded, 60, what="launcher record with 2 takeovers")
        assert shown["pid"] == cluster.gateway.pid and shown["restarts"] == 2
        spare = standby.spare
    assert spare.returncode == 0  # SIGTERM while standing by: a clean exit, nothing was served


# -- the healer's rules with a standby, on small children that speak the protocol ------------------
# Without --standby-fd: a "gateway" that runs until killed. With it: a standby that says READY,
# waits for SERVE, then does what `after_serve` says.
def _gateway(tmp_path: Path, after_serve: str, standby_start: str = "") -> ServiceProcess:
    code = (
        "import socket, sys, time\n"
        "if '--standby-fd' not in sys.argv:\n"
        "    time.sleep(600)\n"
        f"{standby_start}\n"
        "link = socket.socket(fileno=int(sys.argv[sys.argv.index('--standby-fd') + 1]))\n"
        "link.sendall(b'ready\\n')\n"
        "if link.makefile('rb').readline() != b'serve\\n':\n"
        "    raise SystemExit(0)\n"
        f"{after_serve}\n"
    )
    return ServiceProcess(role="gateway", index=0, argv=[sys.executable, "-c", code],
                          log_path=tmp_path / "gateway-0.log", grpc_address="127.0.0.1:1")  # fmt: skip


def _heal_until(healer: Healer, kind: str, timeout_s: float = 60.0) -> list[HealEvent]:
    events: list[HealEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events += healer.check()
        if any(e.kind == kind for e in events):
            return events
        time.sleep(0.02)
    raise AssertionError(f"no {kind!r} event: {[e.message for e in events]}")


def test_a_crash_looping_gateway_still_backs_off_and_stops_at_the_limit(tmp_path) -> None:
    supervisor = Supervisor(grace_s=5.0)
    gateway = supervisor.start(_gateway(tmp_path, after_serve="raise SystemExit(3)"))
    policy = RestartPolicy(limit=2, backoff_s=0.3, backoff_max_s=1.0, stable_s=3600.0)
    standby = Standby(gateway, supervisor, policy)
    healer = Healer(supervisor, policy, standbys={"gateway-0": standby})
    try:
        standby.spawn()
        _heal_until(healer, "standby_ready")
        first_spare = standby.spare.pid
        gateway.signal(signal.SIGKILL)
        events = _heal_until(healer, "gave_up")
        kinds = [e.kind for e in events if not e.kind.startswith("standby")]
        assert kinds == ["exited", "promoted", "exited", "promoted", "gave_up"], [e.message for e in events]
        exited = [e.message for e in events if e.kind == "exited"]
        assert "takes over now" in exited[0] and "takes over in 0.6 s" in exited[1]  # delay(2)
        assert f"is now pid {first_spare}" in events[1].message
        gave_up = [e.message for e in events if e.kind == "gave_up"]  # a standby event may follow it
        assert "--restart-limit 2" in gave_up[0]
        assert healer.gave_up is gateway and gateway.restarts == 2 == standby.takeovers
        assert gateway.exits == [-9, 3, 3]
        assert all(e.kind.startswith("standby") for e in healer.check())  # the gateway is left down
        assert healer.launcher_doc()["services"]["gateway-0"]["state"] == "gave_up"
    finally:
        supervisor.stop_all(grace_s=5.0)


def test_a_standby_that_keeps_dying_is_given_up_and_the_gateway_restarts_cold(tmp_path) -> None:
    supervisor = Supervisor(grace_s=5.0)
    gateway = supervisor.start(_gateway(tmp_path, after_serve="time.sleep(600)",
                                        standby_start="raise SystemExit(5)"))  # fmt: skip
    policy = RestartPolicy(limit=2, backoff_s=0.3, backoff_max_s=1.0, stable_s=3600.0)
    standby = Standby(gateway, supervisor, policy)
    healer = Healer(supervisor, policy, standbys={"gateway-0": standby})
    try:
        standby.spawn()
        events = _heal_until(healer, "standby_failed")
        kinds = [e.kind for e in events]
        assert kinds == ["standby_exited", "standby_started", "standby_exited", "standby_started",
                         "standby_failed"], [e.message for e in events]  # fmt: skip
        assert "exited with code 5" in events[0].message and standby.state == "failed"
        assert standby.spare is None and supervisor.spares == []
        old_pid = gateway.pid
        gateway.signal(signal.SIGKILL)
        events = _heal_until(healer, "restarted")
        assert [e.kind for e in events] == ["exited", "restarted"]
        assert "restarting it in 0.3 s" in events[0].message  # no standby: the usual backoff, delay(1)
        assert gateway.is_running and gateway.pid != old_pid and standby.takeovers == 0
    finally:
        supervisor.stop_all(grace_s=5.0)
