"""The healing half of `tandem up`: a service that dies on its own is started again.

    child exits (crash, SIGKILL, OOM)  ->  "exited"   : restart due in backoff(streak) seconds
    backoff over                       ->  "restarted": same argv, same ports, restarts += 1
                                           "promoted" : instead, with a warm standby (standby.py),
                                                        the standby's process serves on those ports
    `limit` quick deaths in a row      ->  "gave_up"  : left down (`tandem up` then stops the
                                                        cluster: a crash loop is a bug to read)

A service with a standby skips only the first wait of a streak (a takeover costs milliseconds, so
there is nothing to back off from); a death within `stable_s` of the takeover backs off as any
restart does, and counts towards `limit` the same.

The rest of the cluster keeps serving meanwhile: the gateway routes around a dead worker and
migrates its streams (docs/reliability.md); a restarted worker re-registers under the same id.
Backoff doubles from `backoff_s` to `backoff_max_s` per quick death; a run of `stable_s` or
more resets it (like systemd's StartLimitBurst/IntervalSec, not Kubernetes' unbounded loop).

What the healer did is published in Redis (`{cluster}:launcher`, JSON, short TTL) so that
`tandem status` shows restarts per service; the write is best effort and off the healing thread
(a Redis outage must not delay a restart).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.launcher.supervisor import ServiceProcess, Supervisor

if TYPE_CHECKING:
    from services.launcher.standby import Standby

logger = logging.getLogger(__name__)

CHECK_INTERVAL_S = 0.2
RECORD_INTERVAL_S = 5.0
RECORD_TTL_S = 15.0


@dataclass(frozen=True)
class RestartPolicy:
    """limit: restarts in a row without a stable run (0: never restart, a death is fatal)."""

    limit: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_s: float = 60.0

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"restart limit must be >= 0, got {self.limit}")
        if self.backoff_s <= 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"restart backoff must be > 0 and <= its max, got {self.backoff_s}, "
                             f"{self.backoff_max_s}")  # fmt: skip

    def delay(self, streak: int) -> float:
        """Seconds before restart number `streak` (1-based) of an unbroken run of quick deaths."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, streak - 1))


@dataclass(frozen=True)
class HealEvent:
    kind: str  # "exited" | "restarted" | "promoted" | "gave_up" | "standby_{started,ready,exited,failed}"
    process: ServiceProcess
    message: str
    log_path: Path | None = None  # the log of the run that died (a takeover switches process.log_path)


@dataclass
class _State:
    streak: int = 0  # quick deaths in a row
    due: float | None = None  # when the pending restart happens
    gave_up: bool = False


@dataclass
class Healer:
    """Watches a supervisor's children and restarts the dead ones per `policy`."""

    supervisor: Supervisor
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    on_event: Callable[[HealEvent], None] | None = None
    record: Callable[[dict[str, Any]], None] | None = None  # publishes launcher_doc() (Redis)
    standbys: dict[str, Standby] = field(default_factory=dict)  # service name -> its warm standby
    history: deque[HealEvent] = field(default_factory=lambda: deque(maxlen=200))  # the latest events
    _states: dict[str, _State] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)
    _dirty: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    @property
    def gave_up(self) -> ServiceProcess | None:
        """A service left down after `limit` quick deaths, or None."""
        return next((p for p in self.supervisor.processes if self._state(p).gave_up), None)

    def _state(self, process: ServiceProcess) -> _State:
        return self._states.setdefault(process.name, _State())

    def check(self, now: float | None = None) -> list[HealEvent]:
        """One pass over the children: note deaths, start the restarts that are due."""
        now = time.monotonic() if now is None else now
        events: list[HealEvent] = []
        with self._lock:
            for process in list(self.supervisor.processes):
                if self.supervisor.stopping:
                    break
                events += self._check_one(process, self._state(process), now)
            for standby in self.standbys.values():
                if not self.supervisor.stopping:
                    events += standby.poll(now)
            self.history.extend(events)
        for event in events:
            (logger.error if event.kind == "gave_up" else logger.warning)("%s", event.message)
            if self.on_event is not None:
                self.on_event(event)
        if events:
            self._dirty.set()
        return events

    def _check_one(self, process: ServiceProcess, state: _State, now: float) -> list[HealEvent]:
        if state.gave_up or process.popen is None:
            return []
        events = []
        if state.due is None:
            if process.is_running:
                return []
            events.append(self._note_exit(process, state, now))
        if state.due is None or now < state.due:  # given up, or the backoff is not over yet
            return events
        state.due = None
        standby = self.standbys.get(process.name)
        promoted = standby.promote(process) if standby is not None else None
        if promoted is not None:
            return [*events, promoted]
        process.restarts += 1
        process.start()
        return [*events, HealEvent("restarted", process, f"tandem up: restarted {process.name} (pid {process.pid}, "
                                   f"restart {process.restarts})")]  # fmt: skip

    def _note_exit(self, process: ServiceProcess, state: _State, now: float) -> HealEvent:
        """A death: count it in the streak, give up or set when the restart (or takeover) is due."""
        code = process.returncode
        process.exits.append(int(code) if code is not None else -1)
        state.streak = 1 if now - process.started_at >= self.policy.stable_s else state.streak + 1
        if state.streak > self.policy.limit:
            state.gave_up = True
            return HealEvent("gave_up", process, f"tandem up: {process.name} exited with code {code}; "
                             f"not restarting it ({state.streak - 1} restarts in a row, --restart-limit "
                             f"{self.policy.limit})", log_path=process.log_path)  # fmt: skip
        standby = self.standbys.get(process.name)
        warm = standby is not None and standby.can_take_over
        delay = 0.0 if warm and state.streak == 1 else self.policy.delay(state.streak)
        state.due = now + delay
        how = "its standby takes over" + (" now" if delay == 0 else f" in {delay:.1f} s") if warm \
            else f"restarting it in {delay:.1f} s"
        return HealEvent("exited", process, f"tandem up: {process.name} exited with code {code}; {how} (the rest "
                         "keeps serving)", log_path=process.log_path)  # fmt: skip

    def launcher_doc(self) -> dict[str, Any]:
        """What `tandem status` shows: the launcher and, per service, its pid, state, restarts."""
        services = {}
        with self._lock:
            for p in self.supervisor.processes:
                state = self._state(p)
                status = ("gave_up" if state.gave_up else "restarting" if state.due is not None
                          else "running" if p.is_running else "exited")  # fmt: skip
                services[p.name] = {"role": p.role, "pid": p.pid, "state": status, "restarts": p.restarts,
                                    "exit_codes": p.exits[-5:], "grpc_address": p.grpc_address}  # fmt: skip
                if p.name in self.standbys:
                    services[p.name]["standby"] = self.standbys[p.name].doc()
        return {"launcher_pid": os.getpid(), "updated_at": time.time(), "services": services}

    # -- background -------------------------------------------------------------------------
    def start(self) -> Healer:
        self._threads = [threading.Thread(target=self._heal_forever, name="tandem-healer", daemon=True)]
        if self.record is not None:
            self._threads.append(threading.Thread(target=self._record_forever, name="tandem-record", daemon=True))
        for thread in self._threads:
            thread.start()
        return self

    def quiesce(self) -> None:
        """Returns once no check is in progress; with supervisor.stopping set, none starts
        anything after (so stop_all sees every child the healer started, with its pid)."""
        with self._lock:
            pass

    def stop(self) -> None:
        self._stop.set()
        self._dirty.set()
        for thread in self._threads:
            thread.join(timeout=5.0)

    def _heal_forever(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.check()
            except Exception:  # a bug here must not end healing silently for the whole run
                logger.exception("healer pass failed")

    def _record_forever(self) -> None:
        assert self.record is not None
        while not self._stop.is_set():
            try:
                self.record(self.launcher_doc())
            except Exception as e:  # Redis down: the next pass writes it again
                logger.debug("launcher record not written: %s", e)
            self._dirty.wait(RECORD_INTERVAL_S)
            self._dirty.clear()


def redis_recorder(redis_url: str, cluster: str) -> Callable[[dict[str, Any]], None]:
    """A `record` callback that writes the launcher document to the cluster's Redis."""
    from services.runtime.registry import Registry

    registry = Registry(redis_url, cluster)

    def record(doc: dict[str, Any]) -> None:
        registry.record_launcher(doc, RECORD_TTL_S)

    return record
