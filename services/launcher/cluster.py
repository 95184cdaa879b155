"""A local Tandem cluster as a Python object: what `tandem up` runs and what tests/cluster uses.

    with start_cluster("models/default", num_decode=2, engine_args=["--num-kv-blocks", "256"]) as c:
        openai.OpenAI(base_url=c.http_url + "/v1", api_key="-")...
        c.kill("decode", 1)                      # SIGKILL one worker
    # leaving the block stops every service (SIGTERM, grace, SIGKILL), then the private Redis

Each service is `python -m services.cli <role> ...` with the flags of services/runtime/settings.py:
the launcher owns the flags that wire the cluster together (model, ports, Redis, namespace, mode)
and passes every other flag to each service whose option table has it (`--num-kv-blocks` to the
engine services, `--prefill-chunk-size` to the gateway, `--log-level` to all).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.models.gguf_convert import resolve_model_path
from services.launcher.healing import Healer, HealEvent, RestartPolicy, redis_recorder
from services.launcher.readiness import StartupError, wait_until_ready
from services.launcher.standby import Standby
from services.launcher.supervisor import ServiceProcess, Supervisor
from services.runtime import certs
from services.runtime import settings as service_settings
from services.runtime.listen_socket import bind_listener
from services.runtime.local_stream import SOCKET_PATH_MAX
from services.runtime.redis_server import RedisServerProcess, find_free_port
from services.runtime.tls import TlsIdentity

logger = logging.getLogger(__name__)

MODES = service_settings.GATEWAY_MODES
# Flags the launcher sets itself (users give them to `tandem up` under the names on the right).
RESERVED_FLAGS: dict[str, str] = {
    "--model": "--model / --draft-model", "--host": "--host", "--advertise-host": "(set by tandem up)",
    "--grpc-port": "--grpc-port (gateway; workers get free ports)", "--http-port": "--port",
    "--metrics-port": "(free ports, set by tandem up)", "--redis-url": "--redis-url",
    "--cluster": "--cluster", "--mode": "--mode", "--standby-fd": "--standby-gateway",
    "--http-fd": "(set by tandem up)", "--local-socket": "(set by tandem up; --no-local-sockets: gRPC only)",
}
INTERNAL_HOST = "127.0.0.1"  # workers of a local cluster talk over loopback whatever --host is
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
AUTO_THREADS = "auto"


def available_cores() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), not the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class LaunchError(ValueError):
    """A bad `tandem up` option; the message names it."""


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Validated on construction."""

    model: str
    draft_model: str | None = None
    mode: str = "disaggregated"
    num_prefill: int | None = None  # None: 1 when disaggregated, 0 when aggregated
    num_decode: int = 1
    host: str = "127.0.0.1"  # the gateway's bind address
    http_port: int = 8000  # 0: a free port
    grpc_port: int = 50051  # 0: a free port
    redis_url: str | None = None  # None: start a private redis-server
    cluster: str | None = None  # None: "tandem-<8 hex>"
    torch_threads: int | str = 1  # per engine process, or "auto": the box's cores split between them
    extra_args: tuple[str, ...] = ()  # service flags, routed by each service's option table
    service_args: Mapping[str, Sequence[str]] = field(default_factory=dict)  # role -> flags (last wins)
    run_dir: str | None = None  # None: .tandem/runs/<time>-<cluster>
    startup_timeout_s: float = 180.0
    grace_s: float = 10.0
    env: Mapping[str, str] = field(default_factory=dict)  # extra environment of every service
    api_keys: tuple[str, ...] = ()  # the gateway's API keys (passed by env, kept out of argv and logs)
    tls_dir: str | None = None  # mTLS everywhere with `tandem certs` files from here (made if absent)
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # limit 0: no healing
    standby_gateway: bool = False  # keep a warm standby gateway (`tandem up` default: on); needs healing

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise LaunchError(f"--mode {self.mode!r}: must be one of {', '.join(MODES)}")
        num_prefill = self.num_prefill
        if num_prefill is None:
            num_prefill = 1 if self.mode == "disaggregated" else 0
        if self.mode == "aggregated" and num_prefill:
            raise LaunchError(f"--prefill {num_prefill}: aggregated mode runs no prefill workers")
        if self.mode == "disaggregated" and num_prefill < 1:
            raise LaunchError(f"--prefill {num_prefill}: disaggregated mode needs >= 1 prefill worker")
        object.__setattr__(self, "num_prefill", num_prefill)
        if self.num_decode < 1:
            raise LaunchError(f"--decode {self.num_decode}: need >= 1 decode worker")
        if self.torch_threads != AUTO_THREADS and (not isinstance(self.torch_threads, int) or self.torch_threads < 1):
            raise LaunchError(f"--torch-threads {self.torch_threads}: must be >= 1 or {AUTO_THREADS!r}")
        # A .gguf model is converted once here (cached), so the services all get the same folder.
        for name in ("model", "draft_model"):
            if getattr(self, name) is not None:
                try:
                    object.__setattr__(self, name, resolve_model_path(getattr(self, name)))
                except (OSError, ValueError) as e:
                    raise LaunchError(f"--{name.replace('_', '-')} {getattr(self, name)!r}: {e}") from e
        if not Path(self.model, "config.json").is_file():
            raise LaunchError(f"--model {self.model!r}: no config.json there "
                              "(get one: tandem fetch-model smollm2-135m-instruct, or tandem make-model)")
        if self.draft_model is not None and not Path(self.draft_model, "config.json").is_file():
            raise LaunchError(f"--draft-model {self.draft_model!r}: no config.json there")
        for name in ("http_port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise LaunchError(f"{name}={getattr(self, name)}: must be 0..65535")
        if self.cluster is None:
            object.__setattr__(self, "cluster", f"tandem-{uuid.uuid4().hex[:8]}")
        unknown_roles = set(self.service_args) - set(service_settings.SERVICES)
        if unknown_roles:
            raise LaunchError(f"service_args: unknown roles {sorted(unknown_roles)}")
        route_extra_args(self.extra_args, self.roles)  # fail now, not in four child processes
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        if any("," in key or not key.strip() for key in self.api_keys):
            raise LaunchError("--api-key: a key must be non-empty and contain no comma")

    def threads_per_engine(self, role: str = "decode") -> int:
        """torch threads of an engine process (prefill, decode, draft). "auto": the cores this
        process may use, split evenly between the prefill and decode engines (at least 1 each): on
        one box aggregated serving gives its decode worker every core. A draft worker on the same
        box takes turns with the decode worker it drafts for (decode waits for each Propose, the
        draft idles while decode verifies), so both get the decode worker's share: on a CPU
        box one core cannot stream weights at the memory's bandwidth, and measured with a real
        draft, taking turns on both cores beat splitting them (docs/performance.md)."""
        if self.torch_threads != AUTO_THREADS:
            return int(self.torch_threads)
        engines = self.num_decode + int(self.num_prefill or 0)
        return max(1, available_cores() // engines)

    @property
    def roles(self) -> tuple[str, ...]:
        roles = ["gateway", "decode"] + (["prefill"] if self.num_prefill else [])
        return tuple(roles + (["draft"] if self.draft_model else []))


# -- flag routing --------------------------------------------------------------------------------
def _flag_table(roles: Sequence[str]) -> dict[str, tuple[bool, set[str]]]:
    """flag -> (is_bool, roles that accept it), with --no-X forms for booleans."""
    table: dict[str, tuple[bool, set[str]]] = {}
    for role in roles:
        for opt in service_settings.options(role):
            names = [opt.flag] + ([f"--no-{opt.flag[2:]}"] if opt.is_bool else [])
            for name in names:
                table.setdefault(name, (opt.is_bool, set()))[1].add(role)
    return table


def route_extra_args(args: Sequence[str], roles: Sequence[str]) -> dict[str, list[str]]:
    """Split pass-through flags by the services that take them: role -> argv fragment."""
    table = _flag_table(service_settings.SERVICES)
    routed: dict[str, list[str]] = {role: [] for role in roles}
    tokens = list(args)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        flag, has_value, value = token.partition("=")
        if not flag.startswith("--"):
            raise LaunchError(f"unexpected argument {token!r}")
        if flag in RESERVED_FLAGS:
            raise LaunchError(f"{flag} is set by tandem up; use {RESERVED_FLAGS[flag]}")
        if flag not in table:
            raise LaunchError(f"unknown flag {flag}: not a flag of tandem gateway/prefill/decode/draft")
        is_bool, takers = table[flag]
        fragment = [token]
        if not is_bool and not has_value:
            if i + 1 >= len(tokens):
                raise LaunchError(f"{flag} needs a value")
            fragment.append(tokens[i + 1])
            i += 1
        for role in takers & set(roles):
            routed[role].extend(fragment)
        i += 1
    return routed


def _flag_given(fragment: Sequence[str], flag: str) -> bool:
    return any(token == flag or token.startswith(flag + "=") for token in fragment)


def _flag_value(fragment: Sequence[str], flag: str) -> str | None:
    """The last value given to `flag` in an argv fragment (--flag V or --flag=V), or None."""
    value = None
    for i, token in enumerate(fragment):
        if token == flag and i + 1 < len(fragment):
            value = fragment[i + 1]
        elif token.startswith(flag + "="):
            value = token.partition("=")[2]
    return value


# -- TLS: one `tandem certs` folder for the whole local cluster ----------------------------------
def _tls_args(spec: ClusterSpec, role: str) -> list[str]:
    if not spec.tls_dir:
        return []
    files = certs.files(spec.tls_dir, role)
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def _tls_identity(spec: ClusterSpec, name: str) -> TlsIdentity | None:
    if not spec.tls_dir:
        return None
    files = certs.files(spec.tls_dir, name)
    return TlsIdentity.load(files.cert, files.key, files.ca)


# -- the running cluster -------------------------------------------------------------------------
@dataclass
class Cluster:
    """A started cluster: endpoints, processes, and stop()/kill()."""

    spec: ClusterSpec
    supervisor: Supervisor
    redis_url: str
    run_dir: Path
    redis_server: RedisServerProcess | None = None  # set when the launcher started Redis
    healer: Healer | None = None  # restarts dead services once the cluster is up
    http_socket: socket.socket | None = None  # the gateway's REST port, held here (listen_socket.py)
    _stopped: bool = False

    @property
    def cluster(self) -> str:
        return str(self.spec.cluster)

    @property
    def processes(self) -> list[ServiceProcess]:
        return self.supervisor.processes

    @property
    def gateway(self) -> ServiceProcess:
        return self.supervisor.find("gateway")

    @property
    def http_url(self) -> str:
        return str(self.gateway.http_url)

    @property
    def grpc_address(self) -> str:
        return self.gateway.grpc_address

    def service(self, role: str, index: int = 0) -> ServiceProcess:
        return self.supervisor.find(role, index)

    def workers(self, role: str) -> list[ServiceProcess]:
        return [p for p in self.processes if p.role == role]

    def kill(self, role: str, index: int = 0, signum: int = signal.SIGKILL) -> int | None:
        """Send `signum` (default SIGKILL) to one service and wait for it; returns its exit code
        (None for a signal that does not end it, e.g. SIGSTOP). The healer restarts it later."""
        process = self.supervisor.find(role, index)
        popen = process.popen
        process.signal(signum)
        if signum in (signal.SIGSTOP, signal.SIGCONT) or popen is None:
            return None
        with contextlib.suppress(Exception):
            popen.wait(self.spec.grace_s)
        return popen.poll()

    @property
    def standby(self) -> Standby | None:
        """The gateway's warm standby (spec.standby_gateway and healing on), else None."""
        return self.healer.standbys.get(self.gateway.name) if self.healer is not None else None

    def start_healing(self, on_event: Callable[[HealEvent], None] | None = None) -> Healer | None:
        """Restart services that die from now on (per spec.restart); None when the limit is 0.
        With spec.standby_gateway, also start the gateway's warm standby (a takeover is a restart)."""
        if self.spec.restart.limit == 0 or self.healer is not None:
            return self.healer
        healer = Healer(self.supervisor, self.spec.restart, on_event=on_event,
                        record=redis_recorder(self.redis_url, self.cluster))  # fmt: skip
        if self.spec.standby_gateway:
            standby = Standby(self.gateway, self.supervisor, self.spec.restart)
            standby.spawn()
            healer.standbys[self.gateway.name] = standby
        self.healer = healer.start()
        return self.healer

    def stop(self) -> dict[str, int | None]:
        """Stop every service (SIGTERM, grace, SIGKILL), then the private Redis. Idempotent."""
        if self._stopped:
            return {}
        self._stopped = True
        self.supervisor.stopping = True
        # Children stop before the healer's thread ends: a child it started has PR_SET_PDEATHSIG
        # tied to that thread, and would get a second SIGTERM (the thread's end) beside stop_all's,
        # which could land while it exits (a standby then ended -15, not 0).
        if self.healer is not None:
            self.healer.quiesce()
        codes = self.supervisor.stop_all()
        if self.healer is not None:
            self.healer.stop()
        if self.http_socket is not None:
            self.http_socket.close()
        if self.redis_server is not None:
            self.redis_server.close()
        return codes

    def status_command(self) -> str:
        return f"tandem status --redis-url {self.redis_url} --cluster {self.cluster}"

    def describe(self) -> str:
        """The endpoints and where the logs are, as `tandem up` prints them."""
        host = self.spec.host if self.spec.host not in service_settings.WILDCARD_HOSTS else "127.0.0.1"
        lines = [
            f"Tandem cluster {self.cluster!r} is up ({self.spec.mode}, model {self.spec.model})",
            f"  OpenAI REST   {self.gateway.http_url.split(':', 1)[0]}://{host}:{self.gateway.http_url.rsplit(':', 1)[1]}/v1",
            f"  gRPC          {host}:{self.grpc_address.rsplit(':', 1)[1]}  (tandem.v1.Generation)",
            f"  Redis         {self.redis_url}" + ("  (private, stopped with the cluster)" if self.redis_server else ""),
            f"  status        {self.status_command()}",
            f"  logs          {self.run_dir}/",
        ]  # fmt: skip
        for p in self.processes:
            where = p.http_url or p.metrics_url or ""
            lines.append(f"    {p.name:<10} pid {p.pid:<7} grpc {p.grpc_address:<21} {where}")
        for p in self.supervisor.spares:
            lines.append(f"    {p.name:<10} pid {p.pid:<7} warm: takes over {p.role}-{p.index}'s ports if it dies")
        return "\n".join(lines)


# -- starting ------------------------------------------------------------------------------------
def _default_run_dir(cluster: str) -> Path:
    return Path(".tandem", "runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{cluster}").resolve()


def local_socket_path(run_dir: Path, cluster: str, index: int) -> str:
    """Decode worker `index`'s Unix socket (the gateway's per-request hop on one box): in the run
    folder, or in the temp folder where that path would be too long for a socket address."""
    path = run_dir / f"decode-{index}.sock"
    if len(str(path).encode()) > SOCKET_PATH_MAX:
        path = Path(tempfile.gettempdir(), f"{cluster}-decode-{index}.sock")
    return str(path)


def _service_argv(role: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", role]


def build_processes(spec: ClusterSpec, redis_url: str, run_dir: Path,
                    http_socket: socket.socket | None = None) -> list[ServiceProcess]:
    """One ServiceProcess per service, argv and ports decided; nothing started. http_socket: the
    gateway's REST port, bound by the launcher and inherited by every gateway process
    (services/runtime/listen_socket.py); without it the gateway binds the port itself."""
    routed = route_extra_args(spec.extra_args, spec.roles)
    common = ["--redis-url", redis_url, "--cluster", str(spec.cluster)]
    processes: list[ServiceProcess] = []
    counts = {"prefill": spec.num_prefill, "decode": spec.num_decode, "draft": 1 if spec.draft_model else 0}
    env = {"PYTHONUNBUFFERED": "1", **spec.env}
    probe_tls = _tls_identity(spec, certs.CLIENT)
    for role in ("draft", "decode", "prefill"):
        for index in range(int(counts[role] or 0)):
            grpc_port, metrics_port = find_free_port(INTERNAL_HOST), find_free_port(INTERNAL_HOST)
            extra = routed[role] + list(spec.service_args.get(role, ()))
            argv = _service_argv(role) + [
                "--model", str(spec.draft_model if role == "draft" else spec.model),
                "--host", INTERNAL_HOST, "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                *common,
            ]  # fmt: skip
            if not _flag_given(extra, "--torch-threads"):
                argv += ["--torch-threads", str(spec.threads_per_engine(role))]
            if role == "draft" and not _flag_given(extra, "--lookahead") and not _flag_given(extra, "--no-lookahead"):
                # Lookahead drafts while decode verifies: right on a device of its own, a loss on
                # cores the two share (the draft would compete with the verification it waits on).
                argv += ["--no-lookahead"]
            if role == "decode":
                argv += ["--local-socket", local_socket_path(run_dir, str(spec.cluster), index)]
            if role == "decode" and spec.draft_model and not _flag_given(extra, "--speculative-method"):
                argv += ["--speculative-method", "draft"]
                if not _flag_given(extra, "--num-speculative-tokens"):
                    argv += ["--num-speculative-tokens", str(DEFAULT_NUM_SPECULATIVE_TOKENS)]
            processes.append(ServiceProcess(
                role=role, index=index, argv=argv + _tls_args(spec, role) + extra,
                log_path=run_dir / f"{role}-{index}.log", grpc_address=f"{INTERNAL_HOST}:{grpc_port}",
                metrics_url=f"http://{INTERNAL_HOST}:{metrics_port}/metrics", env=env, probe_tls=probe_tls,
            ))  # fmt: skip
    gateway_host = INTERNAL_HOST if spec.host in service_settings.WILDCARD_HOSTS else spec.host
    http_port = http_socket.getsockname()[1] if http_socket else spec.http_port or find_free_port(INTERNAL_HOST)
    grpc_port = spec.grpc_port or find_free_port(INTERNAL_HOST)
    argv = _service_argv("gateway") + [
        "--model", str(spec.model), "--host", spec.host, "--grpc-port", str(grpc_port),
        "--http-port", str(http_port), "--mode", spec.mode, *common,
    ]  # fmt: skip
    if http_socket is not None:
        argv += ["--http-fd", str(http_socket.fileno())]
    gateway_args = _tls_args(spec, "gateway") + routed["gateway"] + list(spec.service_args.get("gateway", ()))
    scheme = "https" if spec.tls_dir and _flag_value(gateway_args, "--public-tls") != "off" else "http"
    gateway_env = {**env, "TANDEM_API_KEYS": ",".join(spec.api_keys)} if spec.api_keys else env
    processes.append(ServiceProcess(
        role="gateway", index=0, argv=argv + gateway_args,
        log_path=run_dir / "gateway-0.log", grpc_address=f"{gateway_host}:{grpc_port}",
        http_url=f"{scheme}://{gateway_host}:{http_port}", env=gateway_env,
        probe_tls=probe_tls if scheme == "https" else None,  # --public-tls off: plaintext public ports
        pass_fds=(http_socket.fileno(),) if http_socket is not None else (),
    ))  # fmt: skip
    return processes


def launch(spec: ClusterSpec, *, heal: bool = True,
           on_event: Callable[[HealEvent], None] | None = None) -> Cluster:
    """Start Redis (unless spec.redis_url), every service, and wait until all are ready; then
    (heal) restart what dies, per spec.restart. A death during startup is fatal (StartupError)."""
    redis_server: RedisServerProcess | None = None
    redis_url = spec.redis_url
    if redis_url is None:
        redis_server = RedisServerProcess().start()
        redis_url = redis_server.url
    run_dir = Path(spec.run_dir).resolve() if spec.run_dir else _default_run_dir(str(spec.cluster))
    run_dir.mkdir(parents=True, exist_ok=True)
    if spec.tls_dir and not certs.files(spec.tls_dir, "gateway").ca.exists():
        certs.write_certs(spec.tls_dir)
    cluster = Cluster(spec=spec, supervisor=Supervisor(grace_s=spec.grace_s), redis_url=redis_url,
                      run_dir=run_dir, redis_server=redis_server)  # fmt: skip
    try:
        # The launcher holds the REST port for the cluster's life: a dead gateway's standby (or
        # cold restart) finds the connections that came meanwhile waiting in its backlog.
        cluster.http_socket = bind_listener(spec.host, spec.http_port, listen=True)
        for process in build_processes(spec, redis_url, run_dir, cluster.http_socket):
            cluster.supervisor.start(process)
        expected = {"decode": spec.num_decode, "prefill": int(spec.num_prefill or 0),
                    "draft": 1 if spec.draft_model else 0}  # fmt: skip
        wait_until_ready(cluster.supervisor, timeout_s=spec.startup_timeout_s, redis_url=redis_url,
                         cluster=str(spec.cluster), expected_workers=expected)  # fmt: skip
        if heal:
            cluster.start_healing(on_event)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@contextlib.contextmanager
def start_cluster(model: str | Path, **opts: object) -> Iterator[Cluster]:
    """Start a cluster (ClusterSpec's fields as keyword options), yield it, stop it on exit."""
    if "extra_args" in opts:
        opts["extra_args"] = tuple(str(a) for a in opts["extra_args"])  # type: ignore[union-attr]
    cluster = launch(ClusterSpec(model=str(model), **opts))  # type: ignore[arg-type]
    try:
        yield cluster
    finally:
        cluster.stop()


__all__ = ["Cluster", "ClusterSpec", "LaunchError", "StartupError", "launch", "start_cluster"]
