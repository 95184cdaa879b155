"""Hostile input against a real gateway in front of real workers (decode + prefill, one loop):
requests that can never fit the KV cache are refused at once, a seed the wire cannot carry
reserves nothing, Abort is scoped to its caller, and a stream that fails ends with an error
event, no `[DONE]` and no internal address. Issue 11, defects 4 (second half), 5 and 6."""

from __future__ import annotations

import json
import logging
import threading

import grpc
import httpx
import pytest

from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, generation_pb2, generation_pb2_grpc
from tests.services.gateway_helpers import MiniCluster

NUM_KV_BLOCKS = 64  # x 16 tokens = 1,024 tokens of KV: a quarter of the tiny model's 4,096 context
KV_TOKENS = NUM_KV_BLOCKS * 16
MODES = ("aggregated", "disaggregated")


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url, num_kv_blocks=NUM_KV_BLOCKS)
    yield cluster
    cluster.close()


def _post(url: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(url, json=body, timeout=timeout)


def _error(reply: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


@pytest.mark.parametrize("mode", MODES)
def test_request_that_never_fits_the_kv_cache_is_refused_at_once(mini, mode):
    url = mini.url(mode) + "/v1/completions"
    # Before: the 4,095-id prompt waited in the admission queue until the request timeout.
    _error(_post(url, {"prompt": [7] * 4095, "max_tokens": 1}), 413, "prompt", "kv_capacity_exceeded")
    _error(_post(url, {"prompt": [7] * (KV_TOKENS + 1), "max_tokens": 1}), 413, "prompt", "kv_capacity_exceeded")
    _error(_post(url, {"prompt": [7] * (KV_TOKENS - 10), "max_tokens": 20}), 400, "max_tokens",
           "kv_capacity_exceeded")
    assert mini.decode_at_baseline()


@pytest.mark.parametrize("mode", MODES)
def test_defaulted_max_tokens_fits_what_is_left(mini, mode):
    prompt = [7] * (KV_TOKENS - 8)
    reply = _post(mini.url(mode) + "/v1/completions", {"prompt": prompt, "max_tokens": None, "ignore_eos": True,
                                                       "temperature": 0})
    assert reply.status_code == 200, reply.text  # completions' default of 16 shrank to the 8 left
    assert reply.json()["usage"]["completion_tokens"] == 8
    chat = {"messages": [{"role": "user", "content": "hello " * 220}], "temperature": 0}
    reply = _post(mini.url(mode) + "/v1/chat/completions", chat)  # no max_tokens: what most clients send
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= KV_TOKENS
    assert mini.decode_at_baseline()


@pytest.mark.parametrize("mode", MODES)
def test_seed_outside_int64_reserves_nothing(mini, mode):
    reply = _post(mini.url(mode) + "/v1/completions", {"prompt": "hi", "seed": 2**63, "max_tokens": 2})
    _error(reply, 400, "seed")
    assert mini.decode_at_baseline(timeout=1.0)  # nothing reserved, so nothing to wait for
    ok = _post(mini.url(mode) + "/v1/completions", {"prompt": "hi", "seed": 2**63 - 1, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


LONG = 3000  # tokens: the stream outlives the few RPCs the test makes meanwhile, on any machine


def _long_stream(stub, request_id: str, key: str | None, out: list, started: threading.Event, n: int = 1) -> None:
    req = generation_pb2.GenerateRequest(
        request_id=request_id, token_ids=generation_pb2.TokenIds(ids=list(range(10, 40))),
        sampling=common_pb2.SamplingParams(n=n, max_tokens=LONG, temperature=0.0, ignore_eos=True))
    metadata = (("authorization", key),) if key else None
    try:
        for response in stub.Generate(req, metadata=metadata, timeout=300):
            out.append(response)
            started.set()
    except grpc.RpcError as e:
        out.append(e)
    started.set()


def _finish(out: list, n: int = 1) -> int:
    assert not isinstance(out[-1], Exception), out[-1]
    reasons = [c.finish_reason for r in out for c in r.choices if c.finish_reason]
    assert len(reasons) == n and len(set(reasons)) == 1, reasons
    return reasons[0]


@pytest.fixture
def roomy(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url, prefill=False, num_kv_blocks=512)
    yield cluster
    cluster.close()


def test_abort_reaches_only_the_callers_request(roomy):
    address = f"127.0.0.1:{roomy.gateways['aggregated'].grpc_port}"
    with grpc.insecure_channel(address) as a, grpc.insecure_channel(address) as b:
        stub_a, stub_b = generation_pb2_grpc.GenerationStub(a), generation_pb2_grpc.GenerationStub(b)
        # Two callers (credentials "key-a", "key-b") use the same request id: two requests.
        streams = {}
        for key, stub in (("Bearer key-a", stub_a), ("Bearer key-b", stub_b)):
            out, started = [], threading.Event()
            thread = threading.Thread(target=_long_stream, args=(stub, "shared-id", key, out, started))
            thread.start()
            streams[key] = (thread, out, started)
        for _, _, started in streams.values():
            assert started.wait(120)

        def abort(stub, key=None) -> bool:
            metadata = (("authorization", key),) if key else None
            return stub.Abort(common_pb2.AbortRequest(request_id="shared-id"), timeout=30, metadata=metadata).aborted

        # Someone else (no credential, or another one) cannot abort them (before: the first caller's
        # stream died) ...
        assert not abort(stub_b) and not abort(stub_a, "Bearer key-c")
        # ... each owner can, from another connection too: both were still running.
        assert abort(stub_b, "Bearer key-a") and abort(stub_a, "Bearer key-b")
        for thread, out, _ in streams.values():
            thread.join(120)
            assert _finish(out) == common_pb2.FINISH_REASON_ABORT
            assert sum(len(c.token_ids) for r in out for c in r.choices) < LONG
    assert roomy.decode_at_baseline()


@pytest.fixture
def doomed(tiny_model, redis_url):
    """A cluster whose only decode worker will be stopped mid-stream."""
    cluster = MiniCluster(tiny_model, redis_url, prefill=False, num_kv_blocks=NUM_KV_BLOCKS)
    yield cluster
    cluster.close()


def test_stream_error_ends_without_done_and_without_addresses(doomed):
    events: list[str] = []
    first = threading.Event()

    def read() -> None:
        body = {"prompt": [5] * 8, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", doomed.url("aggregated") + "/v1/completions", json=body, timeout=300) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    first.set()
        first.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert first.wait(120)
    doomed.run(lambda: doomed.decode.server.server.stop(0))  # the worker's gRPC server dies mid-stream
    reader.join(300)
    assert not reader.is_alive()
    assert events and events[-1] != "[DONE]", events[-3:]
    error = json.loads(events[-1])["error"]
    assert error["message"]
    assert doomed.decode.address not in error["message"] and "127.0.0.1" not in error["message"], error


@pytest.fixture
def small_queue(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url, prefill=False, num_kv_blocks=NUM_KV_BLOCKS, max_queued_requests=2)
    yield cluster
    cluster.close()


def _wait(predicate, timeout_s: float = 60.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_admission_counts_each_requests_sequences(small_queue):
    """n = 3 does not fit a queue of 2 (before: n sequences counted as one request, and
    n = 10000 queued past the cap); n = 2 waits, counted as 2, until the worker has room."""
    mini = small_queue
    gateway = mini.gateways["aggregated"].gateway
    with grpc.insecure_channel(mini.decode.address) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        # Hold 59 of the 64 blocks with a reservation whose KV never comes (a real Reserve).
        held = decode.Reserve(decode_pb2.ReserveRequest(request_id="hold", prompt_token_ids=[3] * (59 * 16)),
                              timeout=30)
        assert held.status == decode_pb2.RESERVE_STATUS_RESERVED
        assert _wait(lambda: all(w.kv_blocks_free <= 5 for w in gateway.orchestrator.decode_workers()))
        url = mini.url("aggregated") + "/v1/completions"
        body = {"prompt": [5] * 100, "max_tokens": 2, "temperature": 0}  # 7 blocks: no worker has room
        _error(_post(url, {**body, "n": 3}), 429, None, "queue_full")
        replies: list[httpx.Response] = []
        waiting = threading.Thread(target=lambda: replies.append(_post(url, {**body, "n": 2})))
        waiting.start()
        assert _wait(lambda: gateway.admission.num_waiting == 2)  # it waits on decode, counted as 2
        _error(_post(url, {**body, "n": 1}), 429, None, "queue_full")
        assert decode.Abort(common_pb2.AbortRequest(request_id="hold"), timeout=30).aborted
        waiting.join(120)
    assert replies and replies[0].status_code == 200, replies
    assert len(replies[0].json()["choices"]) == 2
    assert gateway.admission.num_waiting == 0
    assert mini.decode_at_baseline()


@pytest.fixture
def two_at_once(tiny_model, redis_url):
    """Decode runs 2 sequences at once and 2 more may wait: at most 4 in flight."""
    cluster = MiniCluster(tiny_model, redis_url, prefill=False, num_kv_blocks=512, max_num_seqs=2,
                          max_queued_requests=2)
    yield cluster
    cluster.close()


def test_running_sequences_count_against_the_queue_cap(two_at_once):
    """Before: only waiting requests counted, and a LOCAL request (any n > 1) routed to a worker
    with free blocks counted nothing at all, so decode's scheduler queued any number of sequences
    past --max-queued-requests (issue 11: n = 10000 left 8,720 queued)."""
    mini = two_at_once
    gateway = mini.gateways["aggregated"].gateway
    url = mini.url("aggregated") + "/v1/completions"
    body = {"prompt": [5] * 8, "max_tokens": 2, "temperature": 0}
    error = _error(_post(url, {**body, "n": 5}), 429, None, "queue_full")  # 5 > 2 running + 2 waiting
    assert "--max-queued-requests" in error["message"], error
    with grpc.insecure_channel(f"127.0.0.1:{mini.gateways['aggregated'].grpc_port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        out, started = [], threading.Event()
        running = threading.Thread(target=_long_stream, args=(stub, "runs-two", None, out, started, 2))
        running.start()
        assert started.wait(120)
        assert gateway.admission.num_in_flight == 2  # the stream's two sequences, running
        _error(_post(url, {**body, "n": 3}), 429, None, "queue_full")  # 2 running + 3 > 4
        replies: list[httpx.Response] = []
        queued = threading.Thread(target=lambda: replies.append(_post(url, {**body, "n": 2})))
        queued.start()  # fits: it queues on decode behind the stream
        assert _wait(lambda: gateway.admission.num_in_flight == 4)
        _error(_post(url, {**body, "n": 1}), 429, None, "queue_full")
        with pytest.raises(grpc.RpcError) as e:  # the same over gRPC: RESOURCE_EXHAUSTED
            stub.Complete(generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[5] * 8),
                sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0)), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert stub.Abort(common_pb2.AbortRequest(request_id="runs-two"), timeout=30).aborted
        running.join(120)
        queued.join(120)
    assert _finish(out, n=2) == common_pb2.FINISH_REASON_ABORT
    assert replies and replies[0].status_code == 200, replies
    assert len(replies[0].json()["choices"]) == 2
    assert _wait(lambda: gateway.admission.num_in_flight == 0)
    assert mini.decode_at_baseline()


PREFILL_KV_BLOCKS = 8  # x 16 = 128 tokens: smaller than decode's 1,024


@pytest.fixture(scope="module")
def small_prefill(tiny_model, redis_url):
    cluster = MiniCluster(tiny_model, redis_url, num_kv_blocks=NUM_KV_BLOCKS, prefill_kv_blocks=PREFILL_KV_BLOCKS)
    yield cluster
    cluster.close()


def _prefill_tokens(mini: MiniCluster) -> float:
    return mini.prefill.metrics.registry.get_sample_value("tandem_prefill_tokens_total") or 0.0


def test_prompt_over_the_prefill_cache_is_computed_on_decode(small_prefill, caplog):
    """300 tokens fit decode's 1,024 but not prefill's 128: decode computes the prompt, and the
    prefill worker is not asked (before: a Reserve, a prefill call that failed with
    INVALID_ARGUMENT "prompt + max_tokens needs 19 KV blocks but the cache has 8", then the
    same request again, LOCAL)."""
    mini = small_prefill
    body = {"prompt": [7] * 300, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    expected = _post(mini.url("aggregated") + "/v1/completions", body)
    assert expected.status_code == 200, expected.text
    before = _prefill_tokens(mini)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        reply = _post(mini.url("disaggregated") + "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == expected.json()["choices"][0]["token_ids"]
    failures = [r.getMessage() for r in caplog.records if r.name.startswith(("services.prefill", "services.gateway"))]
    assert not failures, failures
    assert _prefill_tokens(mini) == before
    # A prompt that fits prefill's cache still goes there.
    reply = _post(mini.url("disaggregated") + "/v1/completions", {**body, "prompt": [8] * 100})
    assert reply.status_code == 200, reply.text
    assert _prefill_tokens(mini) > before
    assert mini.decode_at_baseline()
