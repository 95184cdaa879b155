"""Redis goes away: the gateway keeps routing with its last known registry, /health stays 200 while
decode answers, and requests keep completing."""

from __future__ import annotations

import time

import httpx

from tests.services.gateway_helpers import MODEL_NAME, MiniCluster


def test_routes_with_last_known_registry(tiny_model, private_redis):
    mini = MiniCluster(tiny_model, private_redis.url, prefill=False, num_kv_blocks=32)
    try:
        url = mini.url("aggregated")
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        before = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
        private_redis.stop()
        for _ in range(3):
            r = httpx.post(url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == before["choices"][0]["text"]
        assert httpx.get(url + "/health").status_code == 200
        view = mini.gateways["aggregated"].gateway.view
        deadline = time.monotonic() + 5
        while view.snapshot().error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert view.snapshot().error is not None and view.workers("decode")  # noticed, kept the list
    finally:
        mini.close()
