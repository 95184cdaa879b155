"""The gateway over a decode worker's Unix socket (services/runtime/local_stream.py), as `tandem up`
runs them on one box: its kept connection carries request after request (decode accepts one
connection, not one per request), a request cut short by its client or by a stop string still
frees decode's blocks, and the answers are transformers' greedy tokens."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.gateway_helpers import MODEL_NAME, MiniCluster


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url):
    with tempfile.TemporaryDirectory(prefix="tandem-sock-") as where:
        cluster = MiniCluster(tiny_model, redis_url, prefill=False, decode_socket=str(Path(where) / "decode.sock"))
        yield cluster
        cluster.close()


def _stream(url: str, body: dict, stop_after: int | None = None) -> list[dict]:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL_NAME, "stream": True, **body},
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
                if stop_after is not None and len(events) >= stop_after:
                    break
    return events


def test_one_kept_connection_carries_every_request(mini, tiny_model):
    url = mini.url("aggregated")
    prompts = random_prompts([7, 19, 33, 50], vocab=1000, seed=21)
    accepted = mini.decode.local.connections_accepted
    tokens = []
    for prompt in prompts:  # one at a time, as one stream does
        events = _stream(url, {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True})  # fmt: skip
        tokens.append([t for e in events for c in e["choices"] for t in c.get("token_ids") or []])
    assert tokens == hf_greedy(tiny_model, prompts, 5)
    assert mini.decode.local.connections_accepted - accepted == 1, "a connection per request, not a kept one"
    assert mini.decode_at_baseline(timeout=10)


def test_a_client_leaving_mid_stream_frees_decode_blocks(mini):
    url = mini.url("aggregated")
    prompt = random_prompts([30], vocab=1000, seed=22)[0]
    got = _stream(url, {"prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}, stop_after=4)
    assert len(got) == 4
    assert mini.decode_at_baseline(timeout=30), "the abandoned request kept its blocks"
    # The connection the cancelled call ran on is gone; the next request is served all the same.
    assert _stream(url, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True})


def test_a_stop_string_ends_the_request_on_decode(mini):
    # The gateway finds stop strings (it owns the detokenizer) and aborts the rest on decode: that
    # call is cancelled, not released, and decode frees what the request held.
    url = mini.url("aggregated")
    prompt = random_prompts([12], vocab=1000, seed=23)[0]
    full = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2:][:3]
    assert stop
    answer = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40,
                                                        "temperature": 0, "ignore_eos": True, "stop": [stop]},
                        timeout=60).json()  # fmt: skip
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert mini.decode_at_baseline(timeout=30), "the stopped request kept its blocks"
