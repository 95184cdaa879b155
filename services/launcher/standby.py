"""A warm standby for the gateway, kept by `tandem up --standby-gateway` (the default).

A cold restart of the gateway is mostly process start-up: importing torch and transformers,
loading the tokenizer, reaching Redis and the decode workers (~12 s on a quiet 2-core box, over
20 s on a loaded one). A standby pays that ahead of time and then waits without binding a port,
so a takeover costs a line on a socket and two binds (services/runtime/standby_link.py):

    spawn()    -> "starting": the gateway's own argv plus --standby-fd N
    poll()     -> "ready" once it says READY (tokenizer loaded, registry read, decode probed)
    promote()  -> SERVE: it binds the gateway's ports and serves; its OS process becomes the
                  gateway's (pid, log, restarts + 1) and the next standby is spawned at once
    it dies unpromoted -> "restarting" after the healer's backoff; more than `limit` such
                  deaths in a row -> "failed": the gateway falls back to cold restarts

The healer (healing.py) decides when a takeover happens and keeps counting deaths, so a gateway
that crash-loops still backs off and is still given up on at --restart-limit.
"""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from services.launcher.healing import HealEvent, RestartPolicy
from services.launcher.supervisor import ServiceProcess, Supervisor
from services.runtime.standby_link import READY, SERVE


@dataclass
class Standby:
    """The warm spare of one service (in `tandem up`: gateway-0) and what happened to its spares."""

    service: ServiceProcess  # the service it stands in for: argv, env, ports
    supervisor: Supervisor  # lists the spare (supervisor.spares), so stop_all stops it too
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    spare: ServiceProcess | None = None
    state: str = "off"  # starting | ready | restarting | failed
    takeovers: int = 0
    failures: int = 0  # spares that died unpromoted, in a row
    ready_at: float | None = None  # time.monotonic() when the current spare said READY
    _respawn_due: float | None = None
    _link: socket.socket | None = None
    _inbox: bytes = b""
    _spawned: int = 0

    @property
    def can_take_over(self) -> bool:
        """A spare is alive (ready, or still starting: then it serves as soon as it is loaded)."""
        return self.spare is not None and self.spare.is_running

    def spawn(self) -> ServiceProcess:
        self._spawned += 1
        ours, theirs = socket.socketpair()
        svc = self.service
        spare = ServiceProcess(
            role=svc.role, index=svc.index, argv=[*svc.argv, "--standby-fd", str(theirs.fileno())],
            log_path=svc.log_path.with_name(f"{svc.role}-{svc.index}-standby-{self._spawned}.log"),
            grpc_address=svc.grpc_address, metrics_url=svc.metrics_url, http_url=svc.http_url, env=svc.env,
            probe_tls=svc.probe_tls, standby=True, pass_fds=(*svc.pass_fds, theirs.fileno()),
        )  # fmt: skip
        try:
            spare.start()
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # the child has its copy
        ours.setblocking(False)
        self._link, self._inbox, self.spare, self.state, self.ready_at = ours, b"", spare, "starting", None
        self.supervisor.spares.append(spare)
        return spare

    def poll(self, now: float) -> list[HealEvent]:
        """Note READY or an unpromoted death of the spare; spawn the next one when due."""
        name = self.service.name
        if self.state == "failed":
            return []
        if self.spare is None:
            if self._respawn_due is None or now < self._respawn_due:
                return []
            self._respawn_due = None
            spare = self.spawn()
            return [HealEvent("standby_started", spare, f"tandem up: started a new standby for {name} "
                              f"(pid {spare.pid})")]  # fmt: skip
        spare = self.spare
        if not spare.is_running:
            code = spare.returncode
            self._drop_spare()
            self.failures += 1
            if self.failures > self.policy.limit:
                self.state = "failed"
                return [HealEvent("standby_failed", spare, f"tandem up: the standby for {name} exited with code "
                                  f"{code}, {self.failures} times in a row; going on without one (cold "
                                  f"restarts)", log_path=spare.log_path)]  # fmt: skip
            delay = self.policy.delay(self.failures)
            self._respawn_due, self.state = now + delay, "restarting"
            return [HealEvent("standby_exited", spare, f"tandem up: the standby for {name} exited with code "
                              f"{code}; starting another in {delay:.1f} s", log_path=spare.log_path)]  # fmt: skip
        if self.state == "starting" and self._said_ready():
            self.state, self.ready_at, self.failures = "ready", now, 0
            return [HealEvent("standby_ready", spare, f"tandem up: standby for {name} ready (pid {spare.pid}, "
                              f"{now - spare.started_at:.1f} s to start; it serves nothing until "
                              f"{name} dies)")]  # fmt: skip
        return []

    def promote(self, process: ServiceProcess) -> HealEvent | None:
        """Tell the spare to serve and make its OS process `process`'s; None if it cannot be told."""
        spare, link, was = self.spare, self._link, self.state
        if spare is None or link is None or not spare.is_running:
            return None
        try:
            link.send(SERVE)
        except OSError:  # it died just now: the healer starts the service cold instead
            return None
        self._drop_spare()
        process.popen, process.log_path, process.started_at = spare.popen, spare.log_path, time.monotonic()
        process.restarts += 1
        self.takeovers += 1
        following = self.spawn()
        warmth = "ready" if was == "ready" else "still starting (it serves once loaded)"
        return HealEvent("promoted", process, f"tandem up: standby promoted: {process.name} is now pid {process.pid} "
                         f"(the standby was {warmth}; restart {process.restarts}, log {process.log_path.name}); "
                         f"next standby pid {following.pid} starting")  # fmt: skip

    def doc(self) -> dict[str, Any]:
        """The launcher record's view (`tandem status`)."""
        return {"state": self.state, "pid": self.spare.pid if self.spare is not None else None,
                "takeovers": self.takeovers}  # fmt: skip

    def _said_ready(self) -> bool:
        with contextlib.suppress(BlockingIOError, InterruptedError, ConnectionError):
            while chunk := self._link.recv(256) if self._link is not None else b"":
                self._inbox += chunk
        return READY in self._inbox

    def _drop_spare(self) -> None:
        if self._link is not None:
            self._link.close()
        if self.spare in self.supervisor.spares:
            self.supervisor.spares.remove(self.spare)
        self._link, self.spare = None, None
