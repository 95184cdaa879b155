"""Helpers for the end-to-end cluster tests: small clusters, REST calls, load and metrics reads.

Everything here talks to real processes: the gateway over HTTP, the workers over gRPC (GetLoad)
and their Prometheus /metrics, the registry in Redis.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.launcher.cluster import Cluster
from services.runtime.registry import Registry
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


# -- REST ------------------------------------------------------------------------------------------
def served_model(base_url: str) -> str:
    """The one model id GET /v1/models lists."""
    reply = httpx.get(f"{base_url}/v1/models", timeout=10.0)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["data"][0]["id"])


def complete_ids(base_url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any) -> list[int]:
    """Greedy /v1/completions of a token-id prompt; returns the generated token ids."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120.0)
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


def get_load(role: str, address: str) -> KVUsage:
    with grpc.insecure_channel(address) as channel:
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
            with grpc.insecure_channel(p.grpc_address) as channel:
                load = _LOAD_STUBS[p.role](channel).GetLoad(common_pb2.GetLoadRequest(check_integrity=True), timeout=30)
            errors[p.name] = load.kv_integrity_error
    return errors


def draft_sequences(cluster: Cluster) -> dict[str, int]:
    """name -> sequences holding draft KV, of every draft worker."""
    counts = {}
    for p in cluster.workers("draft"):
        with grpc.insecure_channel(p.grpc_address) as channel:
            counts[p.name] = draft_pb2_grpc.DraftStub(channel).GetLoad(common_pb2.GetLoadRequest(), timeout=10).num_sequences
    return counts


def kv_usage(cluster: Cluster) -> dict[str, KVUsage]:
    """name -> KV usage of every prefill and decode worker."""
    return {p.name: get_load(p.role, p.grpc_address) for p in cluster.processes if p.role in ("prefill", "decode")}


def metrics(url: str) -> dict[str, float]:
    """Prometheus samples as {'name{label="v",...}': value} (labels sorted; no labels: just name)."""
    text = httpx.get(url, timeout=10.0).text
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
