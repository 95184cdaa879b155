"""The fault table of docs/reliability.md: clients x requests against a `tandem up` cluster
(1 prefill, 2 decode, 1 draft, gateway; healing on), one run per fault.

    fault            what is done once `inject_after` of the requests have finished
    none             nothing (the reference run: its greedy outputs are what every run must give)
    sigkill-decode   SIGKILL decode-0                  -> streams migrate, healer restarts it
    sigkill-prefill  SIGKILL prefill-0                 -> prompts recomputed on decode, restarted
    sigstop-decode   SIGSTOP decode-0 for freeze_s     -> stall detected, streams migrate; SIGCONT
    sigkill-draft    SIGKILL draft-0                   -> decode goes on without speculation
    redis-down       stop Redis for redis_down_s, start it again empty on the same port
    sigkill-gateway  SIGKILL gateway-0                 -> its in-flight requests are lost; clients
                                                          reconnect once its warm standby took
                                                          over (or the healer restarted it cold)

Each client sends its requests one after another (greedy, `return_token_ids`); a request that
cannot connect (the gateway is restarting) is sent again and counted as `reconnects`; one whose
connection breaks mid-way is `lost in flight`; any other non-200 is `failed`; a 200 whose tokens
differ from the reference run is `mismatched`. After the last request the table records how long
each worker's KV took to return to its idle baseline, and the run waits until the cluster is whole
again (every service up and registered, gateway healthy, a standby gateway ready when the cluster
keeps one) before the next fault.

Nothing here asserts a duration: the durations are reported (benchmarks/faults.py prints them),
the tests assert the counts.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from services.launcher.cluster import Cluster
from services.runtime.health_probe import check_grpc
from tests.cluster.cluster_helpers import gateway_metrics, get, kv_usage, post, registered

FAULTS = ("none", "sigkill-decode", "sigkill-prefill", "sigstop-decode", "sigkill-draft", "redis-down",
          "sigkill-gateway")  # fmt: skip
WORKER_FAULTS = tuple(f for f in FAULTS if f not in ("none", "sigkill-gateway"))


@dataclass(frozen=True)
class Load:
    clients: int = 8
    requests_per_client: int = 40
    max_tokens: int = 48
    prompt_lengths: tuple[int, ...] = (9, 23, 40, 57, 80)
    inject_after: float = 0.25  # fraction of all requests finished before the fault
    freeze_s: float = 30.0  # sigstop-decode
    redis_down_s: float = 20.0  # redis-down
    settle_timeout_s: float = 180.0  # heal / KV baseline polls (generous: a loaded machine)
    vocab: int = 1024
    seed: int = 0

    @property
    def num_requests(self) -> int:
        return self.clients * self.requests_per_client

    def prompt(self, client: int, i: int) -> list[int]:
        rng = random.Random(self.seed * 1_000_003 + client * 1009 + i)
        n = self.prompt_lengths[(client + i) % len(self.prompt_lengths)]
        return [rng.randrange(8, self.vocab) for _ in range(n)]


@dataclass
class FaultResult:
    fault: str
    requests: int = 0
    ok: int = 0
    failed: int = 0
    lost_in_flight: int = 0
    mismatched: int = 0
    reconnects: int = 0
    migrations: int = 0  # gateway counter delta (0 when the gateway itself restarted)
    service_back_s: float | None = None  # fault -> first success of a request sent after it
    kv_baseline_s: float | None = None  # last request -> every worker's KV idle at its baseline
    healed_s: float | None = None  # end of the fault -> every service up, registered, gateway healthy
    restarts: dict[str, int] = field(default_factory=dict)
    standby_takeovers: int = 0  # restarts of the gateway that were its warm standby taking over
    errors: list[str] = field(default_factory=list)  # the first few of each kind, for the report
    gateway_back_s: float | None = None  # sigkill-gateway: the kill -> a new process answers HTTP
    gone_s: float | None = None  # sigkill-gateway: the kill -> the process reaped (its sockets closed)
    lost_after_gone: int = 0  # lost requests sent after that: a live gateway lost them (must be 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- faults ----------------------------------------------------------------------------------------
def _sigstop_decode(cluster: Cluster, load: Load) -> None:
    cluster.kill("decode", 0, signal.SIGSTOP)
    time.sleep(load.freeze_s)
    cluster.kill("decode", 0, signal.SIGCONT)


def _redis_down(cluster: Cluster, load: Load) -> None:
    assert cluster.redis_server is not None, "redis-down needs the cluster's private Redis"
    cluster.redis_server.stop()
    time.sleep(load.redis_down_s)
    cluster.redis_server.start()  # same port, empty: the workers re-register


INJECT: dict[str, Callable[[Cluster, Load], None]] = {
    "none": lambda cluster, load: None,
    "sigkill-decode": lambda cluster, load: cluster.kill("decode", 0),
    "sigkill-prefill": lambda cluster, load: cluster.kill("prefill", 0),
    "sigstop-decode": _sigstop_decode,
    "sigkill-draft": lambda cluster, load: cluster.kill("draft", 0),
    "redis-down": _redis_down,
    "sigkill-gateway": lambda cluster, load: cluster.kill("gateway", 0),
}


# -- one run -----------------------------------------------------------------------------------------
def _complete(cluster: Cluster, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    reply = post(cluster, "/v1/completions", json=body, timeout=300.0)  # a new connection per request
    if reply.status_code != 200:
        raise _Failed(f"HTTP {reply.status_code}: {reply.text[:300]}")
    return list(reply.json()["choices"][0]["token_ids"])


class _Failed(Exception):
    pass


@dataclass
class _Run:
    cluster: Cluster
    load: Load
    result: FaultResult
    reference: dict[tuple[int, int], list[int]] | None
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    finished: int = 0
    fault_at: float | None = None
    gone_at: float | None = None  # the killed process was reaped: every socket of it closed
    lock: threading.Lock = field(default_factory=threading.Lock)
    trigger: threading.Event = field(default_factory=threading.Event)

    def client(self, c: int) -> None:
        for i in range(self.load.requests_per_client):
            sent_at = time.monotonic()
            outcome, tokens = self._one(self.load.prompt(c, i))
            with self.lock:
                self.result.requests += 1
                if outcome == "ok":
                    self.outputs[(c, i)] = tokens
                    self.result.ok += 1
                    expected = self.reference.get((c, i)) if self.reference is not None else None
                    if expected is not None and tokens != expected:
                        self.result.mismatched += 1
                        self._note(f"mismatched: client {c} request {i}: tokens differ from the fault-free run")
                    if (self.fault_at is not None and sent_at >= self.fault_at
                            and self.result.service_back_s is None):
                        self.result.service_back_s = round(time.monotonic() - self.fault_at, 3)
                self.finished += 1
                if self.finished >= self.load.inject_after * self.load.num_requests:
                    self.trigger.set()

    def _one(self, prompt: list[int]) -> tuple[str, list[int]]:
        deadline = time.monotonic() + self.load.settle_timeout_s
        while True:
            sent_at = time.monotonic()  # this attempt's: a refused one is sent again later
            try:
                return "ok", _complete(self.cluster, prompt, self.load.max_tokens)
            except httpx.ConnectError as e:  # nothing was sent: the gateway is (re)starting
                with self.lock:
                    self.result.reconnects += 1
                if time.monotonic() > deadline:
                    return self._fail("failed", f"gateway unreachable: {e}")
                time.sleep(0.2)
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                with self.lock:
                    # A request can die with a killed gateway only on a connection made before its
                    # sockets closed (reaped); one made after reached a live gateway.
                    late = self.gone_at is not None and sent_at > self.gone_at
                    self.result.lost_after_gone += late
                when = "" if self.fault_at is None else f" (sent {sent_at - self.fault_at:+.3f} s from the kill)"
                return self._fail("lost_in_flight", f"connection broke mid-request{when}: {e!r}")
            except (_Failed, httpx.HTTPError) as e:
                return self._fail("failed", str(e))

    def _fail(self, kind: str, message: str) -> tuple[str, list[int]]:
        with self.lock:
            setattr(self.result, kind, getattr(self.result, kind) + 1)
            self._note(f"{kind}: {message}")
        return kind, []

    def _note(self, message: str) -> None:
        kind = message.split(":", 1)[0]
        if sum(e.split(":", 1)[0] == kind for e in self.result.errors) < 5:
            self.result.errors.append(message)


def _gateway_migrations(cluster: Cluster) -> float:
    try:
        return gateway_metrics(cluster).get("tandem_request_migrations_total", 0.0)
    except httpx.HTTPError:
        return 0.0


def _gateway_answers(cluster: Cluster) -> bool:
    """A gateway process accepts and answers on the REST port (its /health may still say 503)."""
    try:
        get(cluster, "/health", timeout=5.0)
        return True
    except httpx.HTTPError:  # refused: no process on the port yet
        return False


def cluster_whole(cluster: Cluster) -> bool:
    """Every service running and SERVING, every worker registered, the gateway healthy."""
    if not all(p.is_running for p in cluster.processes):
        return False
    if not all(check_grpc(p.grpc_address, timeout=2.0, tls=p.probe_tls, role=p.role)[0] for p in cluster.processes):
        return False
    expected = {"decode": len(cluster.workers("decode")), "prefill": len(cluster.workers("prefill")),
                "draft": len(cluster.workers("draft"))}  # fmt: skip
    try:
        counts = registered(cluster)
        healthy = get(cluster, "/health", timeout=5.0).status_code == 200
    except Exception:  # Redis or the gateway still coming back
        return False
    return healthy and all(counts.get(role, 0) >= n for role, n in expected.items())


def standby_ready(cluster: Cluster) -> bool:
    """The gateway's warm standby is ready to take over (True when the cluster keeps none)."""
    standby = cluster.standby
    return standby is None or standby.state == "ready"


def kv_idle(cluster: Cluster, baseline: dict[str, int]) -> bool:
    try:
        usage = kv_usage(cluster)
    except Exception:  # a worker still restarting
        return False
    return all(u.idle and u.used <= baseline.get(name, 0) for name, u in usage.items())


def _poll(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> float | None:
    """Seconds until predicate() held, or None if it did not within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return round(time.monotonic() - start, 3)
        time.sleep(interval_s)
    return None


def run_fault(cluster: Cluster, fault: str, load: Load,
              reference: dict[tuple[int, int], list[int]] | None) -> tuple[FaultResult, dict]:
    """One row of the table; returns it and the outputs (the reference, for fault "none")."""
    if _poll(lambda: cluster_whole(cluster) and standby_ready(cluster), load.settle_timeout_s) is None:
        raise RuntimeError(f"cluster not whole before fault {fault}")
    baseline = {name: 0 for name in kv_usage(cluster)}  # idle: every block free (or evictable)
    restarts_before = {p.name: p.restarts for p in cluster.processes}
    takeovers_before = cluster.standby.takeovers if cluster.standby is not None else 0
    migrations_before = _gateway_migrations(cluster)
    run = _Run(cluster, load, FaultResult(fault), reference)
    clients = [threading.Thread(target=run.client, args=(c,), daemon=True) for c in range(load.clients)]
    for t in clients:
        t.start()
    run.trigger.wait(timeout=load.settle_timeout_s)
    run.fault_at = time.monotonic()
    injector = threading.Thread(target=INJECT[fault], args=(cluster, load), daemon=True)
    injector.start()
    healed: list[float] = []

    def watch_gateway() -> None:  # how long the port had no gateway behind it, without a request's latency
        injector.join()  # cluster.kill waits for the process to be reaped
        with run.lock:
            run.gone_at = time.monotonic()
            run.result.gone_s = round(run.gone_at - run.fault_at, 3)
        run.result.gateway_back_s = _poll(lambda: _gateway_answers(cluster), load.settle_timeout_s, 0.02)

    gateway_watcher = threading.Thread(target=watch_gateway, daemon=True)
    if fault == "sigkill-gateway":
        gateway_watcher.start()

    def watch_heal() -> None:  # from the end of the fault (process gone, SIGCONT, Redis back)
        injector.join()
        took = _poll(lambda: cluster_whole(cluster), load.settle_timeout_s)
        if took is not None:
            healed.append(took)

    watcher = threading.Thread(target=watch_heal, daemon=True)
    watcher.start()
    for t in clients:
        t.join()
    last_request_done = time.monotonic()
    result = run.result
    if _poll(lambda: kv_idle(cluster, baseline), load.settle_timeout_s) is not None:
        result.kv_baseline_s = round(time.monotonic() - last_request_done, 3)
    watcher.join()
    if fault == "sigkill-gateway":
        gateway_watcher.join()
    result.healed_s = healed[0] if healed else None
    result.restarts = {p.name: p.restarts - restarts_before.get(p.name, 0) for p in cluster.processes
                       if p.restarts != restarts_before.get(p.name, 0)}  # fmt: skip
    if cluster.standby is not None:
        result.standby_takeovers = cluster.standby.takeovers - takeovers_before
    if fault != "sigkill-gateway":
        result.migrations = int(_gateway_migrations(cluster) - migrations_before)
    return result, run.outputs


def run_table(cluster: Cluster, load: Load, faults: tuple[str, ...] = FAULTS) -> list[FaultResult]:
    """"none" first (the reference outputs), then each fault in turn on the same healing cluster."""
    results, reference = [], None
    for fault in ("none", *[f for f in faults if f != "none"]):
        result, outputs = run_fault(cluster, fault, load, reference)
        if fault == "none":
            reference = outputs
        results.append(result)
    return results


COLUMNS = ("fault", "requests", "ok", "failed", "lost_in_flight", "mismatched", "reconnects", "migrations",
           "service_back_s", "kv_baseline_s", "healed_s")  # fmt: skip


def format_table(results: list[FaultResult]) -> str:
    rows = [[str(getattr(r, c)) if getattr(r, c) is not None else "-" for c in COLUMNS] for r in results]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
