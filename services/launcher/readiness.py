"""Wait until a freshly started cluster can serve: every child healthy, every worker registered.

"Healthy" means "can generate", not "process is up":
  - prefill / decode / draft: grpc.health.v1 Check("") answers SERVING (set after the model loads);
  - gateway: its gRPC health SERVING and GET /health 200 (200 only once it reaches a decode worker);
  - registry: Redis lists as many workers of each role as were started, so the gateway's routing
    sees all of them (a gateway that saw only decode would silently prefill there).
A child that exits while we wait ends the wait at once with its log tail: no one waits out a
timeout for a process that crashed on a bad flag.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.launcher.supervisor import ServiceProcess, Supervisor
from services.runtime.health_probe import check_grpc, check_http

POLL_INTERVAL_S = 0.25


class StartupError(RuntimeError):
    """The cluster did not become ready; names the service and carries its log tail."""

    def __init__(self, message: str, process: ServiceProcess | None = None) -> None:
        self.process = process
        if process is not None:
            message += f"\n--- last lines of {process.log_path} ---\n{process.log_tail()}"
        super().__init__(message)


@dataclass
class Readiness:
    """What is ready so far, and the last reason for what is not (for the timeout message)."""

    ready: set[str] = field(default_factory=set)
    reasons: dict[str, str] = field(default_factory=dict)


def check_process(process: ServiceProcess, timeout_s: float = 1.0) -> tuple[bool, str]:
    """(ready, reason) for one child."""
    healthy, reason = check_grpc(process.grpc_address, timeout=timeout_s, tls=process.probe_tls, role=process.role)
    if healthy and process.http_url is not None:
        healthy, reason = check_http(process.http_url + "/health", timeout=timeout_s, tls=process.probe_tls)
    return healthy, reason


def registered_counts(redis_url: str, cluster: str) -> Counter[str]:
    """Workers per role in the registry (empty when Redis is unreachable)."""
    from services.runtime.registry import Registry, RegistryError

    try:
        with Registry(redis_url, cluster) as registry:
            return Counter(w.role.value for w in registry.list_workers())
    except RegistryError:
        return Counter()


def wait_until_ready(
    supervisor: Supervisor,
    *,
    timeout_s: float,
    redis_url: str,
    cluster: str,
    expected_workers: Mapping[str, int],
) -> None:
    """Block until every child is healthy and `expected_workers` are registered; raise StartupError."""
    state = Readiness()
    deadline = time.monotonic() + timeout_s
    # Workers first: the gateway's /health needs a decode worker anyway.
    ordered = sorted(supervisor.processes, key=lambda p: p.role == "gateway")
    while True:
        dead = supervisor.first_dead()
        if dead is not None:
            raise StartupError(f"{dead.name} exited with code {dead.returncode} during startup", dead)
        for process in ordered:
            if process.name not in state.ready:
                ok, reason = check_process(process)
                state.reasons[process.name] = reason
                if ok:
                    state.ready.add(process.name)
        if len(state.ready) == len(supervisor.processes):
            counts = registered_counts(redis_url, cluster)
            missing = {role: n for role, n in expected_workers.items() if counts[role] < n}
            if not missing:
                return
            state.reasons["registry"] = f"registered {dict(counts)}, expected {dict(expected_workers)}"
        if time.monotonic() > deadline:
            pending = {k: v for k, v in state.reasons.items() if k not in state.ready}
            detail = "; ".join(f"{k}: {v}" for k, v in pending.items())
            slowest = next((p for p in ordered if p.name not in state.ready), None)
            raise StartupError(f"cluster not ready within {timeout_s:.0f} s ({detail})", slowest)
        time.sleep(POLL_INTERVAL_S)
