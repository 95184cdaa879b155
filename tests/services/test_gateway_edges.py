"""The running gateway (real HTTP + gRPC servers, real Redis) without any decode worker: every
edge error comes back in OpenAI shape / as the right gRPC code, and the server stays up."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from services.gateway.main import serve
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.services.gateway_helpers import MODEL_NAME, gateway_settings, served_model


@pytest.fixture
def gateway(tiny_model, redis_url, cluster):
    loop = asyncio.new_event_loop()
    settings = gateway_settings(tiny_model, redis_url, cluster, max_queued_requests=0)
    handle = loop.run_until_complete(serve(settings, http_port=0, grpc_port=0, model=served_model(tiny_model)))
    yield loop, handle
    loop.run_until_complete(handle.stop())
    loop.close()


def _run(loop, coro):
    return loop.run_until_complete(coro)


async def _post(port, path, content, headers=None):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        return await client.post(path, content=content, headers=headers or {"content-type": "application/json"})


def _assert_error(response, status, param):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


def test_http_errors(gateway):
    loop, handle = gateway
    port = handle.http_port
    _assert_error(_run(loop, _post(port, "/v1/completions", b"{oops")), 422, "body")
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": "\xff\xfe"}')), 422, "body")
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": "hi", "temperature": -1}')), 400,
                  "temperature")
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": "hi", "max_tokens": 0}')), 400, "max_tokens")
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": ""}')), 400, "prompt")
    long_prompt = ("[" + ",".join(["5"] * 5000) + "]").encode()
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": ' + long_prompt + b"}")), 413, "prompt")
    _assert_error(_run(loop, _post(port, "/v1/chat/completions", b'{"messages": []}')), 400, "messages")
    _assert_error(_run(loop, _post(port, "/v1/completions", b'{"prompt": "hi", "model": "nope"}')), 404, "model")
    _assert_error(_run(loop, _post(port, "/v1/nothing", b"{}")), 404, None)
    # A valid request with no decode worker registered: 503, streamed or not.
    no_worker = _run(loop, _post(port, "/v1/completions", b'{"prompt": "hi", "stream": true}'))
    _assert_error(no_worker, 503, None)
    assert "no decode worker" in no_worker.json()["error"]["message"]

    async def gets():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            return [await client.get(p) for p in ("/health", "/v1/models", "/metrics")]

    health, models, metrics = _run(loop, gets())
    assert health.status_code == 503
    assert models.json()["data"][0]["id"] == MODEL_NAME
    assert 'tandem_requests_total{outcome="rejected"} 1.0' in metrics.text


def test_grpc_errors_and_metadata_calls(gateway, tiny_model):
    loop, handle = gateway

    async def calls():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.grpc_port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            codes = {}
            bad = generation_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(temperature=-1))
            for name, req in {
                "temperature": bad,
                "prompt": generation_pb2.GenerateRequest(),
                "model": generation_pb2.GenerateRequest(text="hi", model="nope"),
                "unavailable": generation_pb2.GenerateRequest(text="hi"),
            }.items():
                try:
                    await stub.Complete(req)
                except grpc.aio.AioRpcError as e:
                    codes[name] = (e.code(), e.details())
            try:
                async for _ in stub.Generate(bad):
                    pass
            except grpc.aio.AioRpcError as e:
                codes["stream"] = (e.code(), e.details())
            tokens = await stub.Tokenize(generation_pb2.TokenizeRequest(text="hello world"))
            chat = await stub.Tokenize(generation_pb2.TokenizeRequest(chat=generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="hi")])))
            models = await stub.ListModels(generation_pb2.ListModelsRequest())
            aborted = await stub.Abort(common_pb2.AbortRequest(request_id="unknown"))
            return codes, tokens, chat, models, aborted

    codes, tokens, chat, models, aborted = _run(loop, calls())
    assert codes["temperature"][0] == grpc.StatusCode.INVALID_ARGUMENT and codes["temperature"][1].startswith("temperature:")
    assert codes["stream"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert codes["prompt"][0] == grpc.StatusCode.INVALID_ARGUMENT and codes["prompt"][1].startswith("prompt:")
    assert codes["model"][0] == grpc.StatusCode.NOT_FOUND
    assert codes["unavailable"][0] == grpc.StatusCode.UNAVAILABLE
    model = served_model(tiny_model)
    assert list(tokens.token_ids) == model.tokenize("hello world") and len(tokens.tokens) == len(tokens.token_ids)
    assert list(chat.token_ids) == model.tokenize_chat([{"role": "user", "content": "hi"}])
    assert tokens.max_model_len == model.max_model_len
    assert [m.id for m in models.models] == [MODEL_NAME] and not aborted.aborted
