"""The gateway over real decode and prefill workers (in-process gRPC servers), a real Redis and
real weights: outputs, streaming, chat, n, stop strings, logprobs, usage, the openai client,
gRPC, /health and a client disconnect that must free decode's blocks."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.gateway_helpers import MODEL_NAME, MiniCluster

MODES = ("aggregated", "disaggregated")


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url)
    yield cluster
    cluster.close()


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _sse(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json={"model": MODEL_NAME, "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("mode", MODES)
def test_greedy_equals_transformers(mini, tiny_model, mode):
    prompts = random_prompts([5, 37, 70], vocab=1000, seed=3)  # 1 to 5 prefill chunks of 16
    expected = hf_greedy(tiny_model, prompts, 12)
    prefill_tokens_before = mini.prefill.metrics.prefill_tokens._value.get()
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrently, so decode batches them
        answers = list(pool.map(lambda p: _complete(mini.url(mode), prompt=p, max_tokens=12, temperature=0,
                                                    ignore_eos=True, return_token_ids=True), prompts))
    for prompt, answer, want in zip(prompts, answers, expected):
        choice = answer["choices"][0]
        assert answer["prompt_token_ids"] == prompt and choice["token_ids"] == want
        assert choice["finish_reason"] == "length"
        usage = answer["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            len(prompt), 12, len(prompt) + 12)
        assert usage["prompt_tokens_details"]["cached_tokens"] % 16 == 0
    assert mini.decode_at_baseline()
    computed_on_prefill = mini.prefill.metrics.prefill_tokens._value.get() - prefill_tokens_before
    assert (computed_on_prefill > 0) == (mode == "disaggregated")  # aggregated never touches prefill


@pytest.mark.parametrize("mode", MODES)
def test_usage_counts_a_prefix_cache_hit(mini, mode):
    # The same 48-token prompt twice: the second finds its full blocks cached, and usage says so
    # (decode sends usage with the last token: the gateway stops reading once every choice is
    # done, before the stream's closing message), streamed or not.
    prompt = random_prompts([48], vocab=1000, seed=100 + MODES.index(mode))[0]
    first = _complete(mini.url(mode), prompt=prompt, max_tokens=3, temperature=0, ignore_eos=True)
    again = _complete(mini.url(mode), prompt=prompt, max_tokens=3, temperature=0, ignore_eos=True)
    streamed = _sse(mini.url(mode), "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3,
                                                        "temperature": 0, "ignore_eos": True, "stream": True,
                                                        "stream_options": {"include_usage": True}})  # fmt: skip
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32 and cached % 16 == 0
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert mini.decode_at_baseline()


@pytest.mark.parametrize("mode", MODES)
def test_stream_reassembles_to_full(mini, mode):
    body = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    full = _complete(mini.url(mode), **body)
    chunks = _sse(mini.url(mode), "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"]]
    assert text == full["choices"][0]["text"] and ids == full["choices"][0]["token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_chat_n_logprobs_and_stop(mini):
    url = mini.url("aggregated")
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi there"}], "max_completion_tokens": 8,
        "temperature": 0.8, "seed": 7, "n": 2, "logprobs": True, "top_logprobs": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for c in answer["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == 8 and all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
        assert c["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] == 16

    comp = _complete(url, prompt="hello world", max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 6 and all(len(t) <= 3 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])

    # Stop strings: cut a greedy text at a piece of its middle.
    base = _complete(url, prompt="hello world", max_tokens=24, temperature=0, ignore_eos=True)["choices"][0]["text"]
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip() and len(stop) == 3
    cut = _complete(url, prompt="hello world", max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                    return_token_ids=True)
    choice = cut["choices"][0]
    assert choice["text"] == base[: base.index(stop)] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop and cut["usage"]["completion_tokens"] == len(choice["token_ids"]) < 24
    assert mini.decode_at_baseline()  # the gateway aborted the rest on decode


def test_openai_client(mini):
    client = openai.OpenAI(base_url=mini.url("disaggregated") + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    comp = client.completions.create(model=MODEL_NAME, prompt="Once upon", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.usage.completion_tokens == 5 and comp.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content and chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=3, temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_grpc_generation(mini, tiny_model):
    prompt = random_prompts([21], vocab=1000, seed=5)[0]
    want = hf_greedy(tiny_model, [prompt], 8)[0]

    async def calls():
        port = mini.gateways["disaggregated"].grpc_port
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            req = generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=prompt), return_token_ids=True,
                sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            complete = await stub.Complete(req)
            streamed = [m async for m in stub.Generate(req)]
            return complete, streamed

    complete, streamed = mini.run(calls)
    assert list(complete.choices[0].token_ids) == want and list(complete.prompt_token_ids) == prompt
    assert complete.choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert [t for m in streamed for c in m.choices for t in c.token_ids] == want
    assert "".join(c.text for m in streamed for c in m.choices) == complete.choices[0].text
    assert streamed[-1].usage.completion_tokens == 8 and list(streamed[0].prompt_token_ids) == prompt


@pytest.mark.parametrize("mode", MODES)
def test_client_disconnect_frees_decode_blocks(mini, mode):
    body = {"model": MODEL_NAME, "prompt": random_prompts([40], vocab=1000, seed=9)[0], "max_tokens": 1000,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", mini.url(mode) + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
    # The connection is closed mid-stream: decode must be back to its baseline.
    assert mini.decode_at_baseline(timeout=10)
    metrics = httpx.get(mini.url(mode) + "/metrics").text
    assert 'tandem_requests_total{outcome="aborted"}' in metrics


@pytest.mark.parametrize("mode", ["aggregated", "disaggregated"])
def test_non_streaming_client_disconnect_frees_decode_blocks(mini, mode):
    # 1,400 tokens take seconds here (the pool holds 96 blocks of 16 tokens).
    body = json.dumps({"model": MODEL_NAME, "prompt": random_prompts([40], vocab=1000, seed=10)[0],
                       "max_tokens": 1400, "temperature": 0, "ignore_eos": True}).encode()  # fmt: skip

    def gateway_metric(name: str) -> float:
        text = httpx.get(mini.url(mode) + "/metrics").text
        line = next((ln for ln in text.splitlines() if ln.startswith(name)), None)
        return float(line.split()[-1]) if line else 0.0

    aborted = 'tandem_requests_total{outcome="aborted"}'
    before = gateway_metric(aborted)
    port = int(mini.url(mode).rsplit(":", 1)[1])
    # A raw connection, closed once the gateway is generating: a client that gives up mid-request.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        deadline = time.monotonic() + 20
        while gateway_metric("tandem_num_requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gateway_metric("tandem_num_requests_running") >= 1
    assert mini.decode_at_baseline(timeout=10)
    # Cut short by the disconnect, not run to completion (the gateway counts it as it unwinds).
    deadline = time.monotonic() + 10
    while gateway_metric(aborted) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_metric(aborted) == before + 1
