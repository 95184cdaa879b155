"""Child processes of `tandem up`: start each service as its own OS process, stop them all.

Life of a child:
    spawn (own session, stdout+stderr -> its log file, dies with the launcher on Linux)
      -> running -> stop(): SIGTERM, wait `grace_s`, then SIGKILL -> exited (returncode kept)
      -> (died on its own) services/launcher/healing.py restarts it with the same argv and ports,
         or hands its name to a warm standby's process (services/launcher/standby.py)

Each child runs in its own session so a Ctrl-C in the terminal reaches only the launcher, which
then stops the children in order (gateway first, so no new work reaches a worker being stopped).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.runtime.tls import TlsIdentity

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the launcher dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def tail(path: Path, num_lines: int = 30) -> str:
    """The last lines of a log file ("(no log)" when unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 64 * 1024))
            lines = fh.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-num_lines:]) or "(empty log)"


@dataclass
class ServiceProcess:
    """One service child: its role, where it listens, its log, and the OS process."""

    role: str  # "gateway" | "prefill" | "decode" | "draft"
    index: int  # 0, 1, ... within its role
    argv: list[str]
    log_path: Path
    grpc_address: str
    metrics_url: str | None = None  # prefill/decode/draft: http://host:port/metrics
    http_url: str | None = None  # gateway: http://host:port
    env: dict[str, str] = field(default_factory=dict)
    probe_tls: TlsIdentity | None = None  # the client certificate readiness probes present (mTLS)
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0  # times the healer started it again
    started_at: float = 0.0  # time.monotonic() of the last start
    exits: list[int] = field(default_factory=list)  # exit codes of the runs that died on their own
    standby: bool = False  # a warm spare of `role-index`, not yet serving (services/launcher/standby.py)
    pass_fds: tuple[int, ...] = ()  # file descriptors the child inherits (a standby's socket)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}" + ("-standby" if self.standby else "")

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen is not None else None

    @property
    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(  # noqa: S603 (argv built by the launcher)
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env}, start_new_session=True, pass_fds=self.pass_fds,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        self.started_at = time.monotonic()
        logger.info("started %s (pid %s), log %s", self.name, self.pid, self.log_path)

    def signal(self, signum: int) -> None:
        if self.is_running:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def wait(self, timeout_s: float) -> bool:
        """True when the process has exited within timeout_s."""
        if self.popen is None:
            return True
        try:
            self.popen.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def log_tail(self, num_lines: int = 30) -> str:
        return tail(self.log_path, num_lines)


class Supervisor:
    """Starts children and stops them all: SIGTERM to every one, a shared grace period, SIGKILL."""

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self.processes: list[ServiceProcess] = []
        self.spares: list[ServiceProcess] = []  # warm standbys: stopped with the rest, never healed
        self.stopping = False  # set by stop_all: the healer must not restart what we stop

    def start(self, process: ServiceProcess) -> ServiceProcess:
        self.processes.append(process)
        process.start()
        return process

    def find(self, role: str, index: int = 0) -> ServiceProcess:
        for process in self.processes:
            if process.role == role and process.index == index:
                return process
        names = ", ".join(p.name for p in self.processes) or "none"
        raise KeyError(f"no service {role}-{index} (running: {names})")

    def first_dead(self) -> ServiceProcess | None:
        """A child that has exited (crashed during startup, say), or None."""
        return next((p for p in self.processes if p.popen is not None and not p.is_running), None)

    def stop_all(self, order: Sequence[str] = ("gateway", "prefill", "draft", "decode"),
                 grace_s: float | None = None) -> dict[str, int | None]:
        """Stop every child, roles in `order` signalled first; returns name -> exit code."""
        grace_s = self.grace_s if grace_s is None else grace_s
        self.stopping = True
        rank: Mapping[str, int] = {role: i for i, role in enumerate(order)}
        ordered = sorted([*self.spares, *self.processes],
                         key=lambda p: (rank.get(p.role, len(rank)), p.index, not p.standby))
        # Gateway first and alone for a moment: it stops taking work before the workers go away.
        for process in ordered:
            process.signal(signal.SIGTERM)
            if process.role == "gateway" and not process.standby:
                process.wait(min(grace_s, 5.0))
        deadline = time.monotonic() + grace_s
        for process in ordered:
            if not process.wait(max(0.0, deadline - time.monotonic())):
                logger.warning("%s did not exit within %.0f s of SIGTERM: SIGKILL", process.name, grace_s)
                process.signal(signal.SIGKILL)
                process.wait(5.0)
        return {p.name: p.returncode for p in ordered}
