"""A whole disaggregated cluster of processes (`start_cluster`, as `tandem up` runs it) with API
keys and mTLS on: gateway, prefill, decode and a draft worker, certificates made by `tandem certs`
code. The official openai client over HTTPS: completion, streaming and chat; gRPC Generation over
TLS with the key, greedy output equal to transformers'; every worker process refuses plaintext."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.cluster import start_cluster
from services.runtime.tls import Dialer
from tandem.v1 import common_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc, prefill_pb2_grpc
from tests.cluster.cluster_helpers import ENGINE_ARGS, metrics, random_prompts, wait_for
from tests.engine.engine_helpers import hf_greedy
from tests.security.conftest import identity

KEY = "sk-cluster-Key-7"
MAX_TOKENS = 8
# A draft timeout beyond any step: every proposal arrives, so decode -> draft traffic is certain.
SPEC_ARGS = ("--no-speculative-adaptive", "--draft-timeout-ms", "600000", "--num-speculative-tokens", "2")


@pytest.fixture(scope="module")
def secure_cluster(tiny_model, redis_url, tmp_path_factory):
    tls_dir = tmp_path_factory.mktemp("cluster-certs") / "certs"  # empty: start_cluster makes the set
    with start_cluster(
        tiny_model, draft_model=tiny_model, mode="disaggregated", num_prefill=1, num_decode=1, http_port=0,
        grpc_port=0, redis_url=redis_url, extra_args=ENGINE_ARGS + SPEC_ARGS, api_keys=(KEY,),
        tls_dir=str(tls_dir), run_dir=str(tmp_path_factory.mktemp("secure-cluster")),
    ) as cluster:  # fmt: skip
        yield cluster, tls_dir


def _client(cluster, tls_dir, key: str = KEY) -> openai.OpenAI:
    http = httpx.Client(verify=identity(tls_dir, "client").client_ssl_context(), timeout=120)
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=key, http_client=http, max_retries=0)


def test_completion_streaming_and_chat_through_the_secure_cluster(secure_cluster):
    cluster, tls_dir = secure_cluster
    assert cluster.http_url.startswith("https://")
    client = _client(cluster, tls_dir)
    model = client.models.list().data[0].id
    drafted_before = metrics(cluster.service("decode").metrics_url).get("tandem_spec_decode_draft_tokens_total", 0)
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs)
    assert whole.usage.completion_tokens == MAX_TOKENS
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content is not None) >= 1
    # Prefill pushed the prompt's KV to decode (KVTransfer over mTLS), decode drafted over mTLS.
    prefill = metrics(cluster.service("prefill").metrics_url)
    assert prefill["tandem_prefill_tokens_total"] > 0
    decode = metrics(cluster.service("decode").metrics_url)
    assert decode["tandem_spec_decode_draft_tokens_total"] > drafted_before
    with pytest.raises(openai.AuthenticationError) as info:
        _client(cluster, tls_dir, key=KEY.lower()).completions.create(**kwargs)
    assert info.value.body["code"] == "invalid_api_key"


def test_grpc_generation_over_tls_with_the_key(secure_cluster, tiny_model):
    cluster, tls_dir = secure_cluster
    prompt = random_prompts([21], seed=5)[0]
    with Dialer(identity(tls_dir, "client")).channel(cluster.grpc_address, "gateway") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            token_ids=generation_pb2.TokenIds(ids=prompt), return_token_ids=True,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(request, timeout=120)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = stub.Complete(request, timeout=120, metadata=[("authorization", f"Bearer {KEY}")])
        streamed = [t for r in stub.Generate(request, timeout=120, metadata=[("authorization", f"Bearer {KEY}")])
                    for c in r.choices for t in c.token_ids]  # fmt: skip
    assert list(reply.choices[0].token_ids) == streamed == hf_greedy(tiny_model, [prompt], MAX_TOKENS)[0]


def _kv_used(cluster, tls_dir) -> dict[str, tuple[int, int]]:
    """name -> (blocks used, requests running) of every prefill/decode worker, asked over mTLS."""
    out = {}
    dialer = Dialer(identity(tls_dir, "client"))
    for p in cluster.processes:
        if p.role not in ("prefill", "decode"):
            continue
        with dialer.channel(p.grpc_address, p.role) as channel:
            stub = (decode_pb2_grpc.DecodeStub if p.role == "decode" else prefill_pb2_grpc.PrefillStub)(channel)
            load = stub.GetLoad(common_pb2.GetLoadRequest(), timeout=60)
        out[p.name] = (load.num_total_blocks - load.num_free_blocks, load.num_running)
    return out


def test_a_cancelled_stream_frees_kv_on_every_worker(secure_cluster):
    """The abort path (gateway -> decode Abort, prefill release) works over mTLS too."""
    cluster, tls_dir = secure_cluster
    def idle() -> dict[str, tuple[int, int]] | None:
        usage = _kv_used(cluster, tls_dir)
        return usage if all(running == 0 for _, running in usage.values()) else None

    baseline = wait_for(idle, timeout_s=120, what="idle workers")
    body = {"prompt": random_prompts([40], seed=9)[0], "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    http = httpx.Client(verify=identity(tls_dir, "client").client_ssl_context(), timeout=120,
                        headers={"Authorization": f"Bearer {KEY}"})
    body["model"] = http.get(cluster.http_url + "/v1/models").json()["data"][0]["id"]
    with http.stream("POST", cluster.http_url + "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        assert [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
    http.close()  # the client is gone mid-stream
    wait_for(lambda: _kv_used(cluster, tls_dir) == baseline, timeout_s=120, what="KV back to its baseline")


def test_every_worker_process_refuses_plaintext(secure_cluster):
    cluster, _ = secure_cluster
    for process in cluster.processes:
        with grpc.insecure_channel(process.grpc_address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, process.name
