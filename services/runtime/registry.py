"""Cluster registry in Redis: which workers are up, with what load, and where each request went.

Life of a worker record (key schema in docs/redis.md):
  register -> heartbeat every interval (rewrites the whole record, resets its TTL)
           -> deregister on clean shutdown | TTL lapses after a crash -> readers prune the index.

Redis holds soft state only: every worker rewrites its record each heartbeat, so an empty Redis
(restarted without persistence) refills within one heartbeat interval (plus backoff).

Failure behaviour: `Registry` methods raise `RegistryUnavailable` when Redis cannot be reached
(after redis-py's own short retry). The long-running pieces never raise it: `Heartbeater` logs
once and retries with capped exponential backoff (re-registering when Redis is back), and
`CachedRegistryView` keeps serving the last known worker list, with its age, while it retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

DEFAULT_CLUSTER = "tandem"
SCHEMA_VERSION = 1
# Role index sets outlive their members so a torn-down cluster leaves no keys forever.
INDEX_TTL_S = 24 * 3600

# Well-known keys of WorkerInfo.extra (free-form; readers must tolerate their absence).
EXTRA_PREFIX_HASHES = "prefix_hashes"  # decode: recent leading-block hashes, see routing.py
EXTRA_SPEC_ACCEPTANCE_RATE = "spec_acceptance_rate"  # accepted / proposed draft tokens, 0..1
EXTRA_SPEC_MEAN_ACCEPTED_LEN = "spec_mean_accepted_len"  # mean tokens accepted per verify step
EXTRA_SPEC_DRAFT_COST = "spec_draft_token_cost"  # adaptive k's measured price of a draft token (c)
EXTRA_MAX_NUM_SEQS = "max_num_seqs"  # decode: most sequences its engine runs at once (admission)
EXTRA_LOCAL_SOCKET = "local_socket"  # decode: its Unix socket for Generate (services/runtime/local_stream.py)
EXTRA_HOST = "host"  # the worker's host name: a local socket is of use only to clients on the same host


@functools.cache
def _this_host() -> str:
    """Read once: the gateway asks for every request it routes (local_socket_of)."""
    return socket.gethostname()


def local_socket_extra(path: str) -> dict[str, str]:
    return {EXTRA_LOCAL_SOCKET: path, EXTRA_HOST: _this_host()}


def local_socket_of(worker: WorkerInfo) -> str | None:
    """The worker's Unix socket when it has one and runs on this host, else None."""
    path = worker.extra.get(EXTRA_LOCAL_SOCKET)
    if isinstance(path, str) and path and worker.extra.get(EXTRA_HOST) == _this_host():
        return path
    return None


class Role(StrEnum):
    GATEWAY = "gateway"
    PREFILL = "prefill"
    DECODE = "decode"
    DRAFT = "draft"


# -- errors --------------------------------------------------------------------------------------
class RegistryError(Exception):
    """Base of the registry's errors."""


class RegistryUnavailable(RegistryError):
    """Redis could not be reached (connection refused, timeout, server loading)."""


class RegistryDataError(RegistryError):
    """A record in Redis could not be decoded (written by an incompatible version?)."""


# -- records -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerLoad:
    """The numbers a worker reports each heartbeat (from its engine)."""

    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_running: int = 0  # requests in the running batch
    num_waiting: int = 0  # requests queued, not yet scheduled
    queued_tokens: int = 0  # prompt tokens still to compute (prefill's routing signal)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerInfo:
    """One worker's registry record: identity (fixed) + load (refreshed every heartbeat)."""

    worker_id: str
    role: Role
    address: str  # host:port of its gRPC server
    model: str  # model id it serves
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    num_running: int = 0
    num_waiting: int = 0
    queued_tokens: int = 0
    version: str = ""  # tandem version of the worker
    started_at: float = field(default_factory=time.time)  # unix seconds
    updated_at: float = 0.0  # unix seconds of the last heartbeat, stamped by Registry
    extra: dict[str, Any] = field(default_factory=dict)
    # Unix seconds just before the load numbers above were read (<= updated_at; 0: unknown).
    # Routers compare it, not updated_at, with what they sent since (routing.PendingAssignments).
    load_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.worker_id or any(c.isspace() for c in self.worker_id):
            raise ValueError(f"worker_id must be non-empty without whitespace, got {self.worker_id!r}")
        try:
            object.__setattr__(self, "role", Role(self.role))
        except ValueError:
            raise ValueError(
                f"role must be one of {[r.value for r in Role]}, got {self.role!r}"
            ) from None
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")
        for name in ("kv_blocks_free", "kv_blocks_total", "num_running", "num_waiting", "queued_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.kv_blocks_free > self.kv_blocks_total:
            raise ValueError(
                f"kv_blocks_free ({self.kv_blocks_free}) > kv_blocks_total ({self.kv_blocks_total})"
            )

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (0 when the worker has no KV cache)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat (clocks of writer and reader assumed in sync)."""
        return max(0.0, (time.time() if now is None else now) - self.updated_at)

    def with_load(self, load: WorkerLoad, sampled_at: float = 0.0) -> WorkerInfo:
        return replace(
            self,
            load_at=sampled_at,
            kv_blocks_free=load.kv_blocks_free,
            kv_blocks_total=load.kv_blocks_total,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            queued_tokens=load.queued_tokens,
            extra=dict(load.extra),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["role"] = self.role.value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerInfo:
        # Tolerant reader: fields added by newer versions are ignored (rolling upgrades).
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA_VERSION, **self.to_dict()}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> WorkerInfo:
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, TypeError) as exc:
            raise RegistryDataError(f"bad worker record {text[:200]!r}: {exc}") from exc


@dataclass(frozen=True)
class KeySchema:
    """Every key the registry touches, all under "{cluster}:"."""

    cluster: str

    def __post_init__(self) -> None:
        if not self.cluster or any(c.isspace() for c in self.cluster):
            raise ValueError(f"cluster name must be non-empty without whitespace, got {self.cluster!r}")

    @property
    def prefix(self) -> str:
        return f"{self.cluster}:"

    def worker(self, worker_id: str) -> str:
        return f"{self.cluster}:worker:{worker_id}"  # string, JSON WorkerInfo, TTL = heartbeat ttl

    def role_index(self, role: Role | str) -> str:
        return f"{self.cluster}:workers:{Role(role).value}"  # zset worker_id -> updated_at

    def route(self, request_id: str) -> str:
        return f"{self.cluster}:route:{request_id}"  # string, JSON route, TTL = route ttl

    @property
    def launcher(self) -> str:
        return f"{self.cluster}:launcher"  # string, JSON written by `tandem up`, short TTL


def redact_url(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


# Removes index members whose worker key has expired. A script makes check-and-remove atomic, so a
# worker that re-registers between our read and our prune is never dropped from the index.
_PRUNE_SCRIPT = """
for i, member in ipairs(ARGV) do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    redis.call('ZREM', KEYS[1], member)
  end
end
return 0
"""


# -- the registry --------------------------------------------------------------------------------
class Registry:
    """Synchronous access to one cluster's records. Thread-safe (redis-py pools connections).

    Every call fails fast when Redis is down: a short socket timeout and one quick retry
    (redis-py's Retry + ExponentialBackoff), then RegistryUnavailable. Long-lived retrying belongs
    to Heartbeater and CachedRegistryView. The pool reconnects by itself once Redis is back.
    """

    def __init__(
        self,
        redis_url: str,
        cluster: str = DEFAULT_CLUSTER,
        *,
        socket_timeout_s: float = 1.0,
        retries: int = 1,
    ) -> None:
        self.redis_url = redis_url
        self.keys = KeySchema(cluster)
        self._client = redis.Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_connect_timeout=socket_timeout_s,
            socket_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
            health_check_interval=30,
        )
        self._prune = self._client.register_script(_PRUNE_SCRIPT)

    @property
    def cluster(self) -> str:
        return self.keys.cluster

    @property
    def client(self) -> redis.Redis:
        return self._client

    @contextlib.contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError) as exc:
            raise RegistryUnavailable(
                f"Redis at {redact_url(self.redis_url)} unreachable during {operation}: {exc}"
            ) from exc
        except redis.RedisError as exc:
            raise RegistryError(f"Redis error during {operation}: {exc}") from exc

    def ping(self) -> None:
        """Raise RegistryUnavailable unless Redis answers."""
        with self._errors("ping"):
            self._client.ping()

    def server_run_id(self) -> str:
        """Changes whenever the Redis server restarts (and so lost every record)."""
        with self._errors("info"):
            return str(self._client.info("server").get("run_id", ""))

    # workers -------------------------------------------------------------------------------
    def heartbeat(self, info: WorkerInfo, ttl_s: float) -> WorkerInfo:
        """Write the worker's record (stamped with updated_at = now) with a TTL; returns it.

        Idempotent, so it is also how a worker re-registers after Redis lost its records.
        """
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        stamped = replace(info, updated_at=time.time())
        index = self.keys.role_index(stamped.role)
        with self._errors(f"heartbeat of {info.worker_id}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.set(self.keys.worker(stamped.worker_id), stamped.to_json(), px=max(1, int(ttl_s * 1000)))
            pipe.zadd(index, {stamped.worker_id: stamped.updated_at})
            pipe.expire(index, INDEX_TTL_S)
            pipe.execute()
        return stamped

    def register(self, info: WorkerInfo, ttl_s: float) -> WorkerInfo:
        stamped = self.heartbeat(info, ttl_s)
        logger.info("registered %s %s at %s in cluster %r", info.role.value, info.worker_id, info.address, self.cluster)
        return stamped

    def deregister(self, worker_id: str) -> bool:
        """Remove the worker's record and index entries; True if a record existed."""
        with self._errors(f"deregister of {worker_id}"):
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self.keys.worker(worker_id))
            for role in Role:
                pipe.zrem(self.keys.role_index(role), worker_id)
            deleted, *_ = pipe.execute()
        return bool(deleted)

    def get_worker(self, worker_id: str) -> WorkerInfo | None:
        with self._errors(f"get_worker {worker_id}"):
            text = self._client.get(self.keys.worker(worker_id))
        return WorkerInfo.from_json(text) if text is not None else None

    def list_workers(self, role: Role | str | None = None) -> list[WorkerInfo]:
        """Live workers (of one role, or all), sorted by role then worker_id.

        Index entries whose record has expired are pruned on the way. A record that cannot be
        decoded is skipped with a warning: one bad writer must not blind the gateway.
        """
        roles = [Role(role)] if role is not None else list(Role)
        with self._errors("list_workers"):
            pipe = self._client.pipeline(transaction=False)
            for r in roles:
                pipe.zrange(self.keys.role_index(r), 0, -1)
            members: list[tuple[Role, str]] = [
                (r, worker_id) for r, ids in zip(roles, pipe.execute()) for worker_id in sorted(ids)
            ]
            if not members:
                return []
            texts = self._client.mget([self.keys.worker(worker_id) for _, worker_id in members])
            workers: list[WorkerInfo] = []
            stale: dict[Role, list[str]] = {}
            for (r, worker_id), text in zip(members, texts):
                if text is None:
                    stale.setdefault(r, []).append(worker_id)
                    continue
                try:
                    info = WorkerInfo.from_json(text)
                except (RegistryDataError, ValueError) as exc:
                    logger.warning("skipping undecodable record of worker %s: %s", worker_id, exc)
                    continue
                if info.role == r:  # a worker id re-registered under another role shows once
                    workers.append(info)
            for r, ids in stale.items():
                index = self.keys.role_index(r)
                self._prune(keys=[index, *(self.keys.worker(i) for i in ids)], args=ids)
        return workers

    # routes and the launcher record: JSON objects with a TTL -----------------------------------
    @staticmethod
    def _json_record(doc: Mapping[str, Any], ttl_s: float) -> tuple[str, int]:
        """(the text, its TTL in ms) of a JSON record, as _set_json and apply_routes store it."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        return json.dumps(dict(doc), separators=(",", ":")), max(1, int(ttl_s * 1000))

    def _set_json(self, key: str, doc: Mapping[str, Any], ttl_s: float, operation: str) -> None:
        text, ttl_ms = self._json_record(doc, ttl_s)
        with self._errors(operation):
            self._client.set(key, text, px=ttl_ms)

    def _get_json(self, key: str, what: str) -> dict[str, Any] | None:
        with self._errors(f"get {what}"):
            text = self._client.get(key)
        if text is None:
            return None
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise RegistryDataError(f"bad {what}: {text[:200]!r}") from exc
        if not isinstance(doc, dict):
            raise RegistryDataError(f"{what} is not an object: {text[:200]!r}")
        return doc

    def record_route(self, request_id: str, route: Mapping[str, Any], ttl_s: float) -> None:
        """Remember where a request went (e.g. {"prefill": id, "decode": id}) for ttl_s seconds."""
        self._set_json(self.keys.route(request_id), route, ttl_s, f"record_route {request_id}")

    def apply_routes(self, writes: Mapping[str, Mapping[str, Any]], deletes: Iterable[str], ttl_s: float) -> None:
        """Several record_route / delete_route in one round trip (a pipeline; writes first)."""
        records = {request_id: self._json_record(route, ttl_s) for request_id, route in writes.items()}
        with self._errors(f"apply_routes ({len(writes)} writes)"):
            pipe = self._client.pipeline(transaction=False)
            for request_id, (text, ttl_ms) in records.items():
                pipe.set(self.keys.route(request_id), text, px=ttl_ms)
            for request_id in deletes:
                pipe.delete(self.keys.route(request_id))
            pipe.execute()

    def get_route(self, request_id: str) -> dict[str, Any] | None:
        return self._get_json(self.keys.route(request_id), f"route record for {request_id}")

    def record_launcher(self, doc: Mapping[str, Any], ttl_s: float) -> None:
        """`tandem up`'s view of its children (pids, states, restarts) for `tandem status`."""
        self._set_json(self.keys.launcher, doc, ttl_s, "record_launcher")

    def get_launcher(self) -> dict[str, Any] | None:
        return self._get_json(self.keys.launcher, "launcher record")

    def delete_route(self, request_id: str) -> bool:
        with self._errors(f"delete_route {request_id}"):
            return bool(self._client.delete(self.keys.route(request_id)))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# -- retry pacing shared by the background loops ---------------------------------------------------
class _Backoff:
    """Delay before the next attempt: the normal interval while healthy, else capped exponential.

    Logs the first failure of an outage as a warning and the recovery as info; failures in
    between go to debug, so an outage is one line in the log, not one per attempt.
    """

    def __init__(self, interval_s: float, max_backoff_s: float, what: str) -> None:
        if interval_s <= 0 or max_backoff_s <= 0:
            raise ValueError(f"interval_s and max_backoff_s must be > 0, got {interval_s}, {max_backoff_s}")
        self.interval_s = interval_s
        self.max_backoff_s = max(max_backoff_s, interval_s)
        self.what = what
        self.consecutive_failures = 0
        self.outage_started_at: float | None = None

    def on_success(self) -> float:
        if self.consecutive_failures:
            logger.info(
                "%s: Redis reachable again after %d failed attempt(s) over %.1f s",
                self.what, self.consecutive_failures, time.monotonic() - (self.outage_started_at or 0.0),
            )
        self.consecutive_failures = 0
        self.outage_started_at = None
        return self.interval_s

    def on_failure(self, exc: Exception) -> float:
        if self.consecutive_failures == 0:
            self.outage_started_at = time.monotonic()
            logger.warning("%s: %s; retrying with backoff (up to %.1f s)", self.what, exc, self.max_backoff_s)
        else:
            logger.debug("%s: still failing: %s", self.what, exc)
        self.consecutive_failures += 1
        return min(self.max_backoff_s, self.interval_s * 2 ** (self.consecutive_failures - 1))


LoadFn = Callable[[], WorkerLoad]
AsyncLoadFn = Callable[[], "WorkerLoad | Awaitable[WorkerLoad]"]


class _HeartbeatState:
    """What the sync and async heartbeaters share: the record, its TTL, and retry pacing."""

    def __init__(self, registry: Registry, info: WorkerInfo, interval_s: float, ttl_s: float | None,
                 max_backoff_s: float) -> None:
        self.registry = registry
        self.info = info
        self.interval_s = interval_s
        # A few intervals: one lost heartbeat must not drop a healthy worker.
        self.ttl_s = ttl_s if ttl_s is not None else 3 * interval_s
        if self.ttl_s <= interval_s:
            raise ValueError(f"ttl_s ({self.ttl_s}) must exceed interval_s ({interval_s})")
        self.backoff = _Backoff(interval_s, max_backoff_s, f"heartbeat of {info.role.value} {info.worker_id}")
        self.last_success_at: float | None = None  # time.time() of the last written heartbeat
        self.beats = 0
        # A write already in flight when stop() runs (a thread cannot be cancelled) must not land
        # after the deregistration and resurrect the record: both take this lock.
        self._write_lock = threading.Lock()
        self.stopped = False

    def write(self, load: WorkerLoad | None, sampled_at: float = 0.0) -> float:
        """Write one heartbeat (load read at unix time sampled_at); returns the delay before
        the next. Never raises RegistryError."""
        info = self.info.with_load(load, sampled_at) if load is not None else self.info
        with self._write_lock:
            if self.stopped:
                return self.interval_s
            try:
                self.info = self.registry.heartbeat(info, self.ttl_s)
            except RegistryError as exc:
                self.info = info
                return self.backoff.on_failure(exc)
        self.last_success_at = self.info.updated_at
        self.beats += 1
        return self.backoff.on_success()

    def load_failed(self, exc: Exception) -> None:
        logger.exception("heartbeat of %s: load callback failed: %s", self.info.worker_id, exc)

    def stop(self, deregister: bool) -> None:
        with self._write_lock:
            self.stopped = True
            if deregister:
                self._deregister()

    def _deregister(self) -> None:
        try:
            self.registry.deregister(self.info.worker_id)
        except RegistryError as exc:
            logger.warning("could not deregister %s (its record will expire in %.1f s): %s",
                           self.info.worker_id, self.ttl_s, exc)


class _HeartbeatView:
    """What both heartbeaters report about their last beats."""

    _state: _HeartbeatState

    @property
    def info(self) -> WorkerInfo:
        """The last record written (or attempted)."""
        return self._state.info

    @property
    def ttl_s(self) -> float:
        return self._state.ttl_s

    @property
    def last_success_at(self) -> float | None:
        return self._state.last_success_at

    @property
    def consecutive_failures(self) -> int:
        return self._state.backoff.consecutive_failures

    @property
    def num_beats(self) -> int:
        return self._state.beats


class Heartbeater(_HeartbeatView):
    """Keeps one worker registered from a background thread.

    Each interval it calls `load_fn` for fresh numbers and rewrites the record. When Redis is
    down it logs once, retries with capped exponential backoff, and re-registers on recovery;
    it never raises into the service. `load_fn` runs on the heartbeat thread.
    """

    def __init__(
        self,
        registry: Registry,
        info: WorkerInfo,
        load_fn: LoadFn | None = None,
        *,
        interval_s: float = 1.0,
        ttl_s: float | None = None,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._state = _HeartbeatState(registry, info, interval_s, ttl_s, max_backoff_s)
        self._load_fn = load_fn
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat_once(self) -> float:
        """One heartbeat now; returns the delay before the next one."""
        load, sampled_at = None, time.time()
        if self._load_fn is not None:
            try:
                load = self._load_fn()
            except Exception as exc:  # a broken callback must not stop the heartbeats
                self._state.load_failed(exc)
        return self._state.write(load, sampled_at)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            delay = self.beat_once()  # its own time comes off the wait: a steady cadence
            if self._stop.wait(max(0.0, delay - (time.monotonic() - started))):
                break

    def start(self) -> Heartbeater:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._state.stopped = False
            self._thread = threading.Thread(
                target=self._run, name=f"heartbeat-{self._state.info.worker_id}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self, *, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """Stop beating and (by default) remove the record so routers stop at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._state.stop(deregister)

    def __enter__(self) -> Heartbeater:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class AsyncHeartbeater(_HeartbeatView):
    """The asyncio form of Heartbeater, for grpc.aio / FastAPI services.

    `load_fn` runs on the event loop (it may be a coroutine function), so it can read engine
    state owned by the loop; the Redis write runs in a worker thread so a Redis timeout never
    blocks the loop.

    A load read that takes longer than half an interval (it waits for the engine's step, which a
    loaded machine stretches) does not hold up the beat: the record is rewritten with the last
    load (and its older `load_at`) and the read goes on for the next beat. Only while `alive()`
    says the engine is still coming round, though: a hung engine's record is left to expire, so
    routers stop sending it work.
    """

    def __init__(
        self,
        registry: Registry,
        info: WorkerInfo,
        load_fn: AsyncLoadFn | None = None,
        *,
        interval_s: float = 1.0,
        ttl_s: float | None = None,
        max_backoff_s: float = 5.0,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        self._state = _HeartbeatState(registry, info, interval_s, ttl_s, max_backoff_s)
        self._load_fn = load_fn
        self._alive = alive
        self._task: asyncio.Task[None] | None = None
        self._pending: tuple[asyncio.Task[WorkerLoad], float] | None = None  # a load read still running
        # Its own thread for the Redis writes: behind a busy default executor (a burst of
        # to_thread work in the service) a beat would wait its turn and the record expire.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"heartbeat-{info.worker_id}")

    async def _write(self, load: WorkerLoad | None, sampled_at: float = 0.0) -> float:
        return await asyncio.get_running_loop().run_in_executor(self._writer, self._state.write, load, sampled_at)

    async def _read_load(self) -> WorkerLoad:
        result = self._load_fn()
        return await result if inspect.isawaitable(result) else result

    async def beat_once(self) -> float:
        if self._load_fn is None:
            return await self._write(None)
        if self._pending is None:
            # Stamped before the read: a load read late (after a long engine step) then still
            # counts as older than any request routed while it was being read.
            self._pending = (asyncio.ensure_future(self._read_load()), time.time())
        task, sampled_at = self._pending
        await asyncio.wait({task}, timeout=self._state.interval_s / 2)
        if not task.done():
            if self._alive is not None and not self._alive():
                return self._state.interval_s  # hung engine: no beat, the record expires
            return await self._write(None)  # slow engine: last load
        self._pending = None
        load = None
        try:
            load = task.result()
        except Exception as exc:
            self._state.load_failed(exc)
        return await self._write(load, sampled_at)

    async def _run(self) -> None:
        while True:
            # A steady cadence: the time a beat took (its load read, the Redis write, a loaded
            # machine's scheduling) comes off the wait before the next, so beats stay one
            # interval apart rather than drifting toward the TTL.
            started = time.monotonic()
            delay = await self.beat_once()
            await asyncio.sleep(max(0.0, delay - (time.monotonic() - started)))

    def start(self) -> AsyncHeartbeater:
        """Start the heartbeat task on the running loop."""
        if self._task is None or self._task.done():
            self._state.stopped = False
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"heartbeat-{self._state.info.worker_id}"
            )
        return self

    async def stop(self, *, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending is not None:
            self._pending[0].cancel()
            self._pending = None
        await asyncio.get_running_loop().run_in_executor(self._writer, self._state.stop, deregister)

    async def __aenter__(self) -> AsyncHeartbeater:
        return self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


# -- a reader that survives outages ----------------------------------------------------------------
@dataclass(frozen=True)
class RegistrySnapshot:
    """The worker list a router should use now, and how fresh it is."""

    workers: tuple[WorkerInfo, ...]
    fetched_at: float | None  # time.time() of the last successful read; None if never
    error: str | None  # why the last read failed; None when it succeeded
    carried_over: tuple[str, ...] = ()  # ids kept from before an outage, not yet re-registered

    @property
    def connected(self) -> bool:
        return self.error is None and self.fetched_at is not None

    def age_s(self, now: float | None = None) -> float | None:
        if self.fetched_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.fetched_at)

    def of_role(self, role: Role | str) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role == Role(role)]


class CachedRegistryView:
    """The last known worker list, refreshed from Redis in a background thread.

    Reads (`snapshot`, `workers`) only take a lock and never touch the network, so they are safe
    from an event loop. While Redis is down the last list is served with its age and the error;
    refreshes back off (capped) and pick up again by themselves.

    After an outage (or a Redis restart, seen as a new server run_id) Redis is empty until the
    workers' heartbeaters re-register. For `reconnect_grace_s` after recovery, workers known
    before the outage but not yet back are carried over, so the router is not left with nobody.
    """

    def __init__(
        self,
        registry: Registry,
        *,
        refresh_interval_s: float = 1.0,
        max_backoff_s: float = 5.0,
        reconnect_grace_s: float = 10.0,
    ) -> None:
        self.registry = registry
        self.refresh_interval_s = refresh_interval_s
        self.reconnect_grace_s = reconnect_grace_s
        self._backoff = _Backoff(refresh_interval_s, max_backoff_s, f"registry view of {registry.cluster!r}")
        self._lock = threading.Lock()
        self._snapshot = RegistrySnapshot(workers=(), fetched_at=None, error="not refreshed yet")
        self._run_id: str | None = None
        self._before_outage: dict[str, WorkerInfo] = {}
        self._grace_until = 0.0
        self._next_delay_s = refresh_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def snapshot(self) -> RegistrySnapshot:
        with self._lock:
            return self._snapshot

    def workers(self, role: Role | str | None = None) -> list[WorkerInfo]:
        snap = self.snapshot()
        return list(snap.workers) if role is None else snap.of_role(role)

    def refresh(self) -> bool:
        """Read Redis now; True on success. On failure keep the old list and record the error."""
        try:
            run_id = self.registry.server_run_id()
            fresh = self.registry.list_workers()
        except RegistryError as exc:
            self._next_delay_s = self._backoff.on_failure(exc)
            with self._lock:
                old = self._snapshot
                if old.error is None:  # entering an outage: remember who was up
                    self._before_outage = {w.worker_id: w for w in old.workers}
                self._snapshot = replace(old, error=str(exc))
            return False
        self._next_delay_s = self._backoff.on_success()
        now = time.monotonic()
        with self._lock:
            old = self._snapshot
            restarted = self._run_id is not None and run_id != self._run_id
            if restarted and old.error is None:
                self._before_outage = {w.worker_id: w for w in old.workers}
            if old.error is not None or restarted:
                if self._before_outage:
                    self._grace_until = now + self.reconnect_grace_s
            self._run_id = run_id
            carried: list[WorkerInfo] = []
            if now < self._grace_until:
                present = {w.worker_id for w in fresh}
                carried = [w for i, w in self._before_outage.items() if i not in present]
            else:
                self._before_outage = {}
            workers = sorted([*fresh, *carried], key=lambda w: (list(Role).index(w.role), w.worker_id))
            self._snapshot = RegistrySnapshot(
                workers=tuple(workers),
                fetched_at=time.time(),
                error=None,
                carried_over=tuple(w.worker_id for w in carried),
            )
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            if self._stop.wait(self._next_delay_s):
                break

    def start(self) -> CachedRegistryView:
        """Start background refreshing (the first refresh happens at once, on the thread)."""
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name=f"registry-view-{self.registry.cluster}", daemon=True
            )
            self._thread.start()
        return self

    def wait_until_fresh(self, timeout_s: float) -> bool:
        """Block until one refresh has succeeded (startup helper; not for the event loop)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.snapshot().connected:
                return True
            time.sleep(0.02)
        return self.snapshot().connected

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> CachedRegistryView:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
