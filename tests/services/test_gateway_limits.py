"""Hostile input through the running gateway (real HTTP + gRPC servers, real Redis, no decode
worker): every limit answers 4xx in OpenAI's shape / INVALID_ARGUMENT naming the field, before the
work it protects (reading, parsing, tokenizing), and the gateway stays up. Issue 11, defect 6."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from services.gateway import limits
from services.gateway.admission import AdmissionQueue
from services.gateway.errors import Overloaded
from services.gateway.main import serve
from services.gateway.model import ServedModel
from tandem.v1 import generation_pb2
from tests.services.gateway_helpers import gateway_settings, served_model

BODY_LIMIT = 2**20


class CountingModel(ServedModel):
    """The served model, remembering how many characters it was asked to tokenize."""

    tokenized_chars: int = 0

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenized_chars += len(text)
        return super().tokenize(text, add_special_tokens)


@pytest.fixture
def gateway(tiny_model, redis_url, cluster):
    loop = asyncio.new_event_loop()
    base = served_model(tiny_model)
    model = CountingModel(base.name, base.tokenizer, base.max_model_len, base.vocab_size)
    settings = gateway_settings(tiny_model, redis_url, cluster, max_queued_requests=0,
                                max_request_body_bytes=BODY_LIMIT, max_n=8)
    handle = loop.run_until_complete(serve(settings, http_port=0, grpc_port=0, model=model))
    yield loop, handle, model
    loop.run_until_complete(handle.stop())
    loop.close()


def _post(loop, port, path, content, headers=None):
    async def go():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            return await client.post(path, content=content, headers=headers or {"content-type": "application/json"})

    return loop.run_until_complete(go())


def _error(response, status, param, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def _passes_validation(response):
    """No decode worker: a request every check accepted ends in routing's 503."""
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_decode_worker"


def _json(body) -> bytes:
    return json.dumps(body).encode()


def test_body_limit_before_reading(gateway):
    loop, handle, _ = gateway
    port = handle.http_port
    big = b'{"prompt": "' + b"a" * (4 * BODY_LIMIT) + b'"}'
    _error(_post(loop, port, "/v1/completions", big), 413, "body", "request_too_large")

    async def chunked():  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"a" * (BODY_LIMIT // 2)
        yield b'"}'

    _error(_post(loop, port, "/v1/completions", chunked()), 413, "body", "request_too_large")
    padded = _json({"prompt": "hi", "user": "x" * (BODY_LIMIT - 100)})  # just under the limit
    assert len(padded) <= BODY_LIMIT
    _passes_validation(_post(loop, port, "/v1/completions", padded))


def test_deep_json_is_400(gateway):
    loop, handle, _ = gateway
    port = handle.http_port
    for depth in (200, 50_000):  # 50,000 is past Python's recursion limit: RecursionError before
        deep = b'{"prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"
        _error(_post(loop, port, "/v1/completions", deep), 400, "x" if depth == 200 else "body", "too_deep")
    _error(_post(loop, port, "/v1/completions", b"[" * 50_000 + b"]" * 50_000), 400, "body", "too_deep")


def test_lone_surrogates_are_400_naming_the_field(gateway):
    loop, handle, model = gateway
    port = handle.http_port
    # json.dumps writes the escape \ud800, which Python's json decodes to a lone surrogate.
    _error(_post(loop, port, "/v1/completions", _json({"prompt": "hi \ud800 there"})), 400, "prompt", "invalid_string")
    _error(_post(loop, port, "/v1/completions", _json({"prompt": "hi", "stop": ["\udfff"]})), 400, "stop")
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    _error(_post(loop, port, "/v1/chat/completions", _json(chat)), 400, "messages")
    assert model.tokenized_chars == 0
    _passes_validation(_post(loop, port, "/v1/completions", _json({"prompt": "a pair \ud83d\ude00 is fine"})))


@pytest.mark.parametrize(("field", "value"), [
    ("seed", 2**63), ("seed", -(2**63) - 1), ("temperature", 1e9), ("temperature", 2.5),
    ("stop_token_ids", [99999]), ("n", 10_000), ("n", 9),
])
def test_out_of_range_sampling_is_400(gateway, field, value):
    loop, handle, _ = gateway
    _error(_post(loop, handle.http_port, "/v1/completions", _json({"prompt": "hi", field: value})), 400, field)
    chat = {"messages": [{"role": "user", "content": "hi"}], field: value}
    _error(_post(loop, handle.http_port, "/v1/chat/completions", _json(chat)), 400, field)


def test_edges_of_the_ranges_pass(gateway):
    loop, handle, _ = gateway
    for extra in ({"seed": 2**63 - 1}, {"seed": -(2**63)}, {"temperature": 2.0}, {"n": 8},
                  {"stop_token_ids": [1023]}):
        _passes_validation(_post(loop, handle.http_port, "/v1/completions", _json({"prompt": "hi", **extra})))


def test_unknown_chat_role_is_400(gateway):
    loop, handle, _ = gateway
    body = {"messages": [{"role": "wizard", "content": "hi"}]}
    error = _error(_post(loop, handle.http_port, "/v1/chat/completions", _json(body)), 400, "messages")
    assert "wizard" in error["message"]
    for role in ("system", "developer", "user"):
        ok = {"messages": [{"role": role, "content": "hi"}, {"role": "user", "content": "go"}]}
        _passes_validation(_post(loop, handle.http_port, "/v1/chat/completions", _json(ok)))


def test_long_prompt_rejected_without_tokenizing(gateway):
    loop, handle, model = gateway
    port = handle.http_port
    most = model.max_model_len * model.max_token_chars * limits.CHARS_SLACK
    assert most + 1 < BODY_LIMIT
    error = _error(_post(loop, port, "/v1/completions", _json({"prompt": "a" * (most + 1)})), 413, "prompt",
                   "context_length_exceeded")
    assert "not tokenized" in error["message"]
    chat = {"messages": [{"role": "user", "content": "b" * (most // 2 + 1)}] * 2}
    _error(_post(loop, port, "/v1/chat/completions", _json(chat)), 413, "messages")
    ids = {"prompt": [5] * 5000}  # a token list over the context: refused by its length
    _error(_post(loop, port, "/v1/completions", _json(ids)), 413, "prompt")
    assert model.tokenized_chars == 0


def _raw_call(port: int, method: str, payload: bytes):
    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/tandem.v1.Generation/{method}", request_serializer=lambda b: b,
                                       response_deserializer=lambda b: b)
            try:
                await call(payload, timeout=30)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            return grpc.StatusCode.OK, ""

    return go()


def _field(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_grpc_invalid_utf8_is_invalid_argument(gateway):
    loop, handle, _ = gateway
    port = handle.grpc_port
    code, details = loop.run_until_complete(_raw_call(port, "Complete", _field(3, b"hi \xff\xfe")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("text:"), (code, details)
    message = _field(1, b"user") + _field(2, b"\xc3(")  # ChatMessage: role, content
    chat = _field(5, _field(1, _field(1, b"user")) + _field(1, message))  # ChatMessages.messages x2
    code, details = loop.run_until_complete(_raw_call(port, "Complete", chat))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("chat.messages[1].content:"), details
    code, details = loop.run_until_complete(_raw_call(port, "Tokenize", b"\x0a\x05ab"))  # truncated
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    # A valid message still reaches the servicer (no worker: UNAVAILABLE).
    good = generation_pb2.GenerateRequest(text="hi").SerializeToString()
    assert loop.run_until_complete(_raw_call(port, "Complete", good))[0] == grpc.StatusCode.UNAVAILABLE


def test_grpc_bounds_name_the_field(gateway):
    loop, handle, _ = gateway
    bad = {
        "chat": generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="wizard", content="hi")])),
        "temperature": generation_pb2.GenerateRequest(text="hi", sampling={"temperature": 1e9}),
        "stop_token_ids": generation_pb2.GenerateRequest(text="hi", sampling={"stop_token_ids": [99999]}),
        "n": generation_pb2.GenerateRequest(text="hi", sampling={"n": 10_000}),
    }
    for field, msg in bad.items():
        code, details = loop.run_until_complete(_raw_call(handle.grpc_port, "Complete", msg.SerializeToString()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details)
        assert details.split(":")[0] in (field, "messages"), (field, details)


def test_admission_counts_sequences():
    async def go():
        queue = AdmissionQueue(max_waiting=8)
        with queue.slot(5):
            assert queue.num_waiting == 5
            with pytest.raises(Overloaded):
                with queue.slot(4):
                    pass
            with queue.slot(3):
                assert queue.num_waiting == 8
        assert queue.num_waiting == 0

    asyncio.run(go())


def test_openapi_document_is_served(gateway):
    loop, handle, model = gateway

    async def go():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{handle.http_port}", timeout=60) as client:
            return await client.get("/openapi.json")

    doc = loop.run_until_complete(go()).json()
    schemas = doc["components"]["schemas"]
    completion, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]["properties"]
    from services.gateway.openai_schemas import CHAT_SAMPLING, COMPLETION_SAMPLING

    assert set(COMPLETION_SAMPLING) <= set(completion) and set(CHAT_SAMPLING) <= set(chat)
    assert {"prompt", "stream", "stream_options", "model"} <= set(completion) and "messages" in chat
    n = next(a for a in completion["n"]["anyOf"] if a.get("type") == "integer")
    assert n["maximum"] == 8  # --max-n, as served
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
