"""Acceptance 4: streams cancelled mid-prefill and mid-decode free every KV block they held, on
every service: each prefill and decode pool returns to its baseline (GetLoad: used blocks, with
evictable prefix-cache blocks counted as free), nothing left running or waiting for KV."""

from __future__ import annotations

import json

import httpx
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import complete_ids, kv_usage, parallel, random_prompts, wait_for


def _open_stream(base_url: str, prompt: list[int], max_tokens: int) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=60.0)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    request = client.build_request("POST", f"{base_url}/v1/completions", json=body)
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    return client, response


def _tokens_seen(line_iter, want: int) -> int:
    seen = 0
    for line in line_iter:
        if line.startswith("data: ") and line != "data: [DONE]":
            if json.loads(line[6:]).get("choices"):
                seen += 1
        if seen >= want:
            break
    return seen


def _assert_back_to_baseline(cluster: Cluster, baseline: dict[str, int]) -> None:
    def settled():
        usage = kv_usage(cluster)
        return all(u.idle and u.used <= baseline[name] for name, u in usage.items()) and usage

    wait_for(settled, timeout_s=20.0, what=f"KV pools back to baseline {baseline}")
    gateway = httpx.get(cluster.http_url + "/metrics", timeout=10).text
    running = [line for line in gateway.splitlines() if line.startswith("tandem_num_requests_running ")]
    assert running and float(running[0].split()[1]) == 0.0, running


@pytest.fixture
def baseline(disagg: Cluster) -> dict[str, int]:
    usage = kv_usage(disagg)
    assert all(u.idle for u in usage.values()), usage
    return {name: u.used for name, u in usage.items()}


def test_cancel_mid_prefill(disagg: Cluster, baseline) -> None:
    # ~1,000 tokens = ~31 prefill chunks of 32 on a 64-token budget: many steps to cancel inside
    # (sized so all three fit one prefill pool of 256 blocks at once).
    prompts = random_prompts([1200, 1000, 800], seed=4)
    streams = [_open_stream(disagg.http_url, p, max_tokens=4) for p in prompts]
    prefill = disagg.service("prefill")
    # Cancel as soon as prefill holds KV for them: their first tokens are still chunks away.
    busy = wait_for(lambda: (u := kv_usage(disagg))[prefill.name].used > baseline[prefill.name] and u,
                    timeout_s=10.0, interval_s=0.02, what="prefill holding the prompts' KV")  # fmt: skip
    for client, response in streams:
        response.close()
        client.close()
    assert busy[prefill.name].running > 0, busy
    _assert_back_to_baseline(disagg, baseline)


def test_cancel_mid_decode(disagg: Cluster, baseline) -> None:
    prompts = random_prompts([40, 70, 100, 130], seed=5)
    streams = [_open_stream(disagg.http_url, p, max_tokens=2000) for p in prompts]
    for _, response in streams:
        assert _tokens_seen(response.iter_lines(), want=3) == 3
    for client, response in streams:
        response.close()
        client.close()
    _assert_back_to_baseline(disagg, baseline)


def test_cluster_serves_after_cancels(disagg: Cluster) -> None:
    outs = parallel(lambda p: complete_ids(disagg.http_url, p, max_tokens=4), random_prompts([30, 60], seed=6))
    assert [len(o) for o in outs] == [4, 4]
