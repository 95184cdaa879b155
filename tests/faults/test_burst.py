"""Defect 4 (first half) of issue 11 on a real cluster: a burst of 16 streams at once spreads over
both decode workers instead of all landing on the one that looked most free, so one crash can
no longer take out the whole burst. Where each request went is read from the KV each decode
worker received (every prompt here has the same length, so the same bytes)."""

from __future__ import annotations

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import parallel, post, random_prompts, wait_for, worker_metrics
from tests.faults.fault_table import cluster_whole

RECV = 'tandem_kv_transfer_bytes_total{direction="recv"}'


def test_a_burst_of_16_spreads_over_both_decode_workers(fault_cluster: Cluster) -> None:
    cluster = fault_cluster
    wait_for(lambda: cluster_whole(cluster), timeout_s=180, what="cluster whole")
    before = [m.get(RECV, 0.0) for m in worker_metrics(cluster, "decode")]
    prompts = random_prompts([40] * 16, seed=31)

    def one(prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}
        reply = post(cluster, "/v1/completions", json=body, timeout=300.0)
        assert reply.status_code == 200, reply.text

    parallel(one, prompts, workers=16)
    received = [m.get(RECV, 0.0) - b for m, b in zip(worker_metrics(cluster, "decode"), before)]
    assert sum(received) > 0
    assert min(received) >= sum(received) / 4, received  # at least 4 of the 16 on each
