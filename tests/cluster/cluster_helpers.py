"""Helpers for the end-to-end cluster tests: small clusters, REST calls, load and metrics reads.

Everything here talks to real processes: the gateway over HTTPS/HTTP, the workers over gRPC
(GetLoad) and their Prometheus /metrics, the registry in Redis.

Test clusters are secure by default, as production should be: `start_secure_cluster` starts one
with an API key on the gateway and mTLS on every internal channel (TLS on the gateway's public
ports), certificates from the session's `tandem certs` folder (the `dev_certs` fixture). Every
helper that reaches a cluster takes the Cluster and derives how from it (its spec's keys, its
processes' client certificate), so the same helper serves a plaintext cluster too:

    rest(cluster) / get / post        httpx with the key and the client's TLS context
    openai_client(cluster)            the official client, same
    gateway_channel(cluster)          gRPC to tandem.v1.Generation over TLS, key in the metadata
    worker_channel(process)           gRPC to a worker over mTLS (the client certificate)

A test that is about plaintext serving uses `start_cluster` directly and says so.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from ssl import SSLContext
from typing import Any, NamedTuple, TypeVar

import grpc
import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from services.launcher.cluster import Cluster, start_cluster
from services.launcher.supervisor import ServiceProcess
from services.runtime.registry import Registry
from services.runtime.tls import Dialer, TlsIdentity
from tandem.v1 import common_pb2, decode_pb2_grpc, draft_pb2_grpc, prefill_pb2_grpc

BLOCK_SIZE = 16
# Small budgets so a prompt of ~100 tokens takes several prefill chunks and engine steps, and one
# torch thread per process (2 shared cores): see ClusterSpec.torch_threads.
ENGINE_ARGS: tuple[str, ...] = (
    "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", "256", "--max-num-batched-tokens", "64",
    "--dtype", "float32", "--device", "cpu", "--heartbeat-interval", "0.5", "--log-level", "info",
    "--prefill-chunk-size", "32",
)  # fmt: skip
# Draft = target costs a full target step per draft token, so adaptive k rightly measures
# speculation as a loss and turns it off; tests of the mechanism pin k instead.
PINNED_K: tuple[str, ...] = ("--no-speculative-adaptive",)
# Decode speculates only with proposals that come within --draft-timeout-ms (50 ms by default): a
# loaded machine misses that and the step runs without drafts. Tests that count draft tokens give
# the draft all the time it needs, so what they see does not depend on the machine's load.
PATIENT_DRAFT: tuple[str, ...] = ("--draft-timeout-ms", "20000")
PROMPT_LENGTHS = (5, 17, 33, 64, 90, 131)  # 1 to 5 chunks of 32; some end mid-block
MAX_TOKENS = 8
API_KEY = "sk-tandem-Test-Cluster-7"  # mixed case: a case-changed key must not pass (test_cluster_secure)
T = TypeVar("T")


def random_prompts(lengths: Sequence[int], seed: int = 0, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8, vocab) for _ in range(n)] for n in lengths]  # ids < 8: special tokens


def parallel(fn: Callable[..., T], items: Iterable[Any], workers: int = 16) -> list[T]:
    """fn over items on threads, results in input order (exceptions propagate)."""
    items = list(items)
    with ThreadPoolExecutor(max_workers=min(workers, max(1, len(items)))) as pool:
        return list(pool.map(fn, items))


def wait_for(predicate: Callable[[], T], timeout_s: float = 20.0, interval_s: float = 0.2,
             what: str = "condition") -> T:  # fmt: skip
    """Poll until predicate() is truthy; returns its value or fails naming `what` and the last value."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what} not reached within {timeout_s:.0f} s (last: {last!r})")


# -- secure clusters and how to reach them ---------------------------------------------------------
def start_secure_cluster(model: str | Path, tls_dir: Path, **opts: Any):  # -> start_cluster's context manager
    """start_cluster with API_KEY on the gateway and mTLS everywhere from `tls_dir` (`tandem certs`)."""
    return start_cluster(model, api_keys=(API_KEY,), tls_dir=str(tls_dir), **opts)


def api_key(cluster: Cluster) -> str | None:
    return cluster.spec.api_keys[0] if cluster.spec.api_keys else None


def _public_tls(cluster: Cluster) -> TlsIdentity | None:
    """The client certificate to reach the gateway's public ports with (None: they are plaintext)."""
    return cluster.gateway.probe_tls


# Contexts are cached: building one reads PEM files (httpx's default loads certifi's whole bundle,
# ~20-40 ms of CPU), which an httpx client per request would otherwise pay every time.
@lru_cache(maxsize=8)
def _ssl_context(identity: TlsIdentity | None) -> SSLContext:
    return identity.client_ssl_context() if identity is not None else httpx.create_ssl_context()


def _verify(cluster: Cluster) -> SSLContext:
    """httpx's `verify` for the gateway: its CA and our client certificate (plain HTTP: unused)."""
    return _ssl_context(_public_tls(cluster))


def _httpx_options(cluster: Cluster, timeout: float) -> dict[str, Any]:
    key = api_key(cluster)
    return {"verify": _verify(cluster), "timeout": timeout,
            "headers": {"Authorization": f"Bearer {key}"} if key else {}}  # fmt: skip


def rest(cluster: Cluster, timeout: float = 120.0) -> httpx.Client:
    """An httpx client of the gateway (base_url set): TLS verified against the cluster's CA, key sent."""
    return httpx.Client(base_url=cluster.http_url, **_httpx_options(cluster, timeout))


def async_rest(cluster: Cluster, timeout: float = 120.0) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=cluster.http_url, **_httpx_options(cluster, timeout))


def get(cluster: Cluster, path: str, **kwargs: Any) -> httpx.Response:
    """One GET on a new connection (as httpx.get), e.g. get(cluster, "/health")."""
    with rest(cluster, timeout=kwargs.pop("timeout", 120.0)) as client:
        return client.get(path, **kwargs)


def post(cluster: Cluster, path: str, **kwargs: Any) -> httpx.Response:
    """One POST on a new connection (as httpx.post)."""
    with rest(cluster, timeout=kwargs.pop("timeout", 120.0)) as client:
        return client.post(path, **kwargs)


def openai_client(cluster: Cluster, timeout: float = 120.0) -> openai.OpenAI:
    """The official client, no retries (a retry would hide a failure)."""
    http = httpx.Client(verify=_verify(cluster), timeout=timeout)
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=api_key(cluster) or "unused", timeout=timeout,
                         max_retries=0, http_client=http)  # fmt: skip


def async_openai_client(cluster: Cluster, timeout: float = 120.0) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(verify=_verify(cluster), timeout=timeout)
    return openai.AsyncOpenAI(base_url=cluster.http_url + "/v1", api_key=api_key(cluster) or "unused",
                              timeout=timeout, max_retries=0, http_client=http)  # fmt: skip


def langchain_connection(cluster: Cluster, timeout: float = 600.0) -> dict[str, Any]:
    """ChatOpenAI's connection arguments for the gateway (base_url, key, TLS, no retries)."""
    return {"base_url": cluster.http_url + "/v1", "api_key": api_key(cluster) or "unused", "timeout": timeout,
            "max_retries": 0, "http_client": httpx.Client(verify=_verify(cluster), timeout=timeout)}  # fmt: skip


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call (what a client of tandem.v1.Generation sends)."""

    def __init__(self, key: str) -> None:
        self._header = ("authorization", f"Bearer {key}")

    def _with_key(self, details: Any) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._header],
                            details.credentials, details.wait_for_ready, details.compression)  # fmt: skip

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(details), request)


def gateway_channel(cluster: Cluster, address: str | None = None) -> grpc.Channel:
    """A channel to the gateway's public gRPC port (or another gateway replica's `address`):
    TLS verified against the cluster's CA, the key sent on every call."""
    channel = Dialer(_public_tls(cluster)).channel(address or cluster.grpc_address, "gateway")
    key = api_key(cluster)
    return grpc.intercept_channel(channel, _BearerKey(key)) if key else channel


def worker_channel(process: ServiceProcess) -> grpc.Channel:
    """A channel to one service's gRPC port, over mTLS with the cluster's client certificate when
    it has one (what the launcher's readiness probes present)."""
    return Dialer(process.probe_tls).channel(process.grpc_address, process.role)


# -- REST ------------------------------------------------------------------------------------------
def served_model(cluster: Cluster) -> str:
    """The one model id GET /v1/models lists."""
    reply = get(cluster, "/v1/models", timeout=10.0)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["data"][0]["id"])


def complete_ids(cluster: Cluster, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> list[int]:
    """Greedy /v1/completions of a token-id prompt; returns the generated token ids."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    reply = post(cluster, "/v1/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["choices"][0]["token_ids"])


# -- load and metrics ------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVUsage:
    """One worker's KV pool as GetLoad reports it (evictable prefix-cache blocks count as free)."""

    used: int
    total: int
    running: int
    pending: int  # decode: reservations waiting for KV; prefill: transfers in flight

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.pending == 0


def get_load(process: ServiceProcess) -> KVUsage:
    role = process.role
    with worker_channel(process) as channel:
        if role == "decode":
            load = decode_pb2_grpc.DecodeStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
            return KVUsage(load.num_total_blocks - load.num_free_blocks, load.num_total_blocks,
                           load.num_running + load.num_waiting, load.num_waiting_for_kv)  # fmt: skip
        load = prefill_pb2_grpc.PrefillStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=5)
        return KVUsage(load.num_total_blocks - load.num_free_blocks, load.num_total_blocks,
                       load.num_running, load.num_transfers_in_flight)  # fmt: skip


_LOAD_STUBS = {"decode": decode_pb2_grpc.DecodeStub, "prefill": prefill_pb2_grpc.PrefillStub,
               "draft": draft_pb2_grpc.DraftStub}  # fmt: skip


def integrity_errors(cluster: Cluster) -> dict[str, str]:
    """name -> check_integrity() verdict of every prefill, decode and draft worker ("" = intact)."""
    errors = {}
    for p in cluster.processes:
        if p.role in _LOAD_STUBS:
            with worker_channel(p) as channel:
                load = _LOAD_STUBS[p.role](channel).GetLoad(common_pb2.GetLoadRequest(check_integrity=True), timeout=30)
            errors[p.name] = load.kv_integrity_error
    return errors


def draft_sequences(cluster: Cluster) -> dict[str, int]:
    """name -> sequences holding draft KV, of every draft worker."""
    counts = {}
    for p in cluster.workers("draft"):
        with worker_channel(p) as channel:
            counts[p.name] = draft_pb2_grpc.DraftStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10).num_sequences
    return counts


def kv_usage(cluster: Cluster) -> dict[str, KVUsage]:
    """name -> KV usage of every prefill and decode worker."""
    return {p.name: get_load(p) for p in cluster.processes if p.role in ("prefill", "decode")}


def metrics(url: str) -> dict[str, float]:
    """A worker's Prometheus samples (its metrics port is plain HTTP, read-only), as parse_metrics."""
    return parse_metrics(httpx.get(url, timeout=10.0).text)


def gateway_metrics(cluster: Cluster) -> dict[str, float]:
    """The gateway's /metrics, on its public port (HTTPS when the cluster is secure)."""
    return parse_metrics(get(cluster, "/metrics", timeout=10.0).text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples as {'name{label="v",...}': value} (labels sorted; no labels: just name)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def worker_metrics(cluster: Cluster, role: str) -> list[dict[str, float]]:
    return [metrics(str(p.metrics_url)) for p in cluster.workers(role)]


def registered(cluster: Cluster) -> dict[str, int]:
    """Workers per role in the registry."""
    with Registry(cluster.redis_url, cluster.cluster) as registry:
        workers = registry.list_workers()
    counts: dict[str, int] = {}
    for w in workers:
        counts[w.role.value] = counts.get(w.role.value, 0) + 1
    return counts
