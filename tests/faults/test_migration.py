"""Request migration on a real cluster: a stream whose decode worker is SIGKILLed, or frozen
(SIGSTOP: the stall check finds it), mid-stream continues on the other decode worker from the
prompt plus the tokens already sent: the client sees no gap, no duplicate, and exactly the
tokens of an uninterrupted greedy run."""

from __future__ import annotations

import json
import signal

import pytest

from services.launcher.cluster import Cluster
from services.runtime.registry import Registry
from tests.cluster.cluster_helpers import complete_ids, gateway_metrics, random_prompts, rest, wait_for
from tests.faults.fault_table import cluster_whole

MAX_TOKENS = 400  # long enough that the fault lands mid-stream


def _decode_of(cluster: Cluster, request_id: str):
    def lookup():
        with Registry(cluster.redis_url, cluster.cluster) as registry:
            route = registry.get_route(request_id)
        return route and route.get("decode")

    address = wait_for(lookup, timeout_s=60, what=f"route record of {request_id}")
    return next(p for p in cluster.workers("decode") if p.grpc_address == address)


def _stream_with_fault(cluster: Cluster, prompt: list[int], fault) -> tuple[list[int], str | None]:
    """Streams a greedy completion; after 5 tokens calls fault(decode process serving it)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    tokens: list[int] = []
    finish, faulted = None, False
    with rest(cluster, timeout=300.0) as client, client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            if len(tokens) >= 5 and not faulted:
                faulted = True
                fault(_decode_of(cluster, chunk["id"]))
    return tokens, finish


def _migrations(cluster: Cluster) -> float:
    return gateway_metrics(cluster).get("tandem_request_migrations_total", 0.0)


def _sigkill(process) -> None:
    process.signal(signal.SIGSTOP)  # freeze first: the stream cannot finish before the kill
    process.signal(signal.SIGKILL)


@pytest.mark.parametrize("fault", ["sigkill", "sigstop"])
def test_a_stream_migrates_when_its_decode_worker_fails(fault_cluster: Cluster, fault: str) -> None:
    cluster = fault_cluster
    wait_for(lambda: cluster_whole(cluster), timeout_s=180, what="cluster whole")
    prompt = random_prompts([37], seed=21 if fault == "sigkill" else 22)[0]
    expected = complete_ids(cluster, prompt, max_tokens=MAX_TOKENS)
    before = _migrations(cluster)
    frozen = []

    def inject(process) -> None:
        if fault == "sigkill":
            _sigkill(process)
        else:
            process.signal(signal.SIGSTOP)
            frozen.append(process)

    try:
        tokens, finish = _stream_with_fault(cluster, prompt, inject)
    finally:
        for process in frozen:
            process.signal(signal.SIGCONT)
    assert finish == "length"
    assert tokens == expected  # nothing lost, nothing twice, same greedy tokens
    assert _migrations(cluster) >= before + 1
    wait_for(lambda: cluster_whole(cluster), timeout_s=180, what="cluster healed")
