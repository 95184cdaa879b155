"""The OpenAI-compatible REST API (FastAPI): thin handlers over parse -> orchestrator -> shape.

    POST /v1/completions, /v1/chat/completions   (stream: SSE `data: {...}` ... `data: [DONE]`)
    POST /v1/responses                           (responses_api.py; stream: typed SSE events)
    POST /tokenize, /detokenize                  (vLLM's spelling; tokenize_api.py)
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /openapi.json

A streamed request is routed (and admitted) before the 200 goes out, so 429/503/4xx arrive as real
HTTP statuses; an error after the first token arrives as a `data: {"error": ...}` event and then
the stream ends without `data: [DONE]` ([DONE] means the answer is complete). A client that
disconnects mid-stream closes the update generator, which aborts the request on every worker.
The body is read under --max-request-body-bytes and checked by limits.py before parsing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import limits
from services.gateway.errors import GatewayError, NotFound
from services.gateway.openapi import install_openapi, openapi_route
from services.gateway.openai_schemas import (ApiRequest, ChunkWriter, check_model, full_response, parse_chat,
                                             parse_completion, parse_json_body)
from services.gateway.responses_api import ResponseEvents, ResponsesRequest, parse_responses, response_object
from services.gateway.tokenize_api import detokenize, tokenize
from services.gateway.completion_batch import BatchShaper, merge
from services.gateway.orchestrator import count_refusal
from services.gateway.request_types import GenerationUpdate
from services.runtime import tracing

T = TypeVar("T")

logger = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for disconnects and always closes its generator,
    so the request's aborts run even when the client vanished while we waited.

    The stream runs in the request's own task and the first chunk goes out before anything else
    is scheduled; one plain asyncio task watches for the disconnect and cancels the stream. (An
    anyio task group of two tasks, as Starlette does it, put two task starts and its cancel-scope
    bookkeeping between the first token and its chunk: ~13% of the gateway's event-loop samples
    at one stream, py-spy, tiny model.)"""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.current_task()
        left = False

        async def watch() -> None:
            nonlocal left
            await self.listen_for_disconnect(receive)
            left = True
            stream.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())  # starts after the first chunk is sent
        try:
            with contextlib.suppress(OSError):
                await self.stream_response(send)
        except asyncio.CancelledError:
            # Ours (the client left: the stream stops here), or the server's: passed on. Every
            # cancel the watcher asks for lands inside stream_response, never after it returned.
            if not left:
                raise
            stream.uncancel()
        finally:
            watcher.cancel()
            await _close_shielded(self.body_iterator)


async def _close_shielded(updates: AsyncIterator[Any]) -> None:
    """Closes the update stream (which aborts the request on every worker) even if this task is
    cancelled meanwhile (the server stopping): the close goes on in its own task."""
    closing = asyncio.ensure_future(updates.aclose())
    try:
        await asyncio.shield(closing)
    except asyncio.CancelledError:
        await asyncio.wait({closing})
        raise


def error_response(error: GatewayError) -> JSONResponse:
    return JSONResponse(error.to_openai(), status_code=error.http_status)


def build_app(gateway: Any) -> FastAPI:
    """gateway: the running Gateway (model, orchestrator, metrics, is_healthy())."""
    # FastAPI's native telemetry off: the orchestrator's request span is the one SERVER span of a
    # REST request (it lives as long as the SSE stream, and gRPC requests get the same one).
    app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None,  # served below, GET only
                  telemetry={"tracing": False, "operation_spans": False, "metrics": False, "logs": False})
    model = gateway.model
    install_openapi(app, model, gateway.limits)

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        if request.url.path.startswith("/v1/") and request.method == "POST":
            count_refusal(gateway.metrics, exc)
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {request.method} {request.url.path}", code="not_found"))
        return JSONResponse({"error": {"message": str(exc.detail), "type": "invalid_request_error", "param": None,
                                       "code": None}}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "internal_error",
                                       "param": None, "code": None}}, status_code=500)

    def start(api: ApiRequest, request: Request) -> AsyncIterator[tuple[int, GenerationUpdate]]:
        trace_parent = tracing.context_from_headers(request.headers)
        span_name = f"POST {request.scope['path']}"  # not request.url (a URL object per request)
        return merge([gateway.orchestrator.generate(g, trace_parent=trace_parent, span_name=span_name)
                      for g in api.generations])

    async def generate(request: Request, parse) -> Response:
        raw = await limits.read_body(request, gateway.limits.max_request_body_bytes)
        api: ApiRequest = parse(parse_json_body(raw), model)
        return await answer(api, request)

    async def answer(api: ApiRequest, request: Request, responses: ResponsesRequest | None = None) -> Response:
        """Runs a parsed request; responses: answer in the Responses API's shape instead."""
        api.generations = [limits.check_request(g, model, gateway.limits, gateway.kv_capacity())
                           for g in api.generations]
        updates = start(api, request)
        if not api.stream:
            async def gather() -> list[tuple[int, GenerationUpdate]]:
                async with contextlib.aclosing(updates):
                    return [u async for u in updates]

            got = await _unless_disconnected(request, gather())
            if got is None:  # the client left: cancelling closed the updates, which aborts the request
                return Response(status_code=499)
            shaping = BatchShaper(api, model)
            results = shaping.results(got, api.num_choices)
            if responses is not None:
                return JSONResponse(response_object(responses, model, results[0], shaping.usage))
            return JSONResponse(full_response(api, model, results, shaping.usage, shaping.prompt_logprobs))
        try:
            first = await anext(updates)  # routing and admission errors become real statuses
        except BaseException:
            await updates.aclose()
            raise
        writer = ChunkWriter(api, model) if responses is None else ResponseEvents(responses, model)
        return SSEResponse(_sse(api, writer, first, updates))

    async def _sse(api: ApiRequest, writer: ChunkWriter | ResponseEvents, first: tuple[int, GenerationUpdate],
                   updates: AsyncIterator[tuple[int, GenerationUpdate]]):
        shaping = BatchShaper(api, model)
        try:
            if isinstance(writer, ResponseEvents):
                yield writer.start()
            item = first
            while True:
                i, update = item
                choices = shaping.shape(i, update)
                if choices:
                    yield writer.update(choices)
                if update.prompt_logprobs and isinstance(writer, ChunkWriter):
                    yield writer.prompt_logprobs(i, update.prompt_logprobs)
                try:
                    item = await anext(updates)
                except StopAsyncIteration:
                    break
            yield writer.finish(shaping.usage)
        except GatewayError as e:
            yield writer.error(e.to_openai())
        finally:
            await updates.aclose()

    @app.post("/v1/completions", **openapi_route("CompletionRequest"))
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions", **openapi_route("ChatCompletionRequest"))
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat)

    def model_card() -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": model.created, "owned_by": "tandem",
                "max_model_len": model.max_model_len}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        raw = await limits.read_body(request, gateway.limits.max_request_body_bytes)
        parsed = parse_responses(parse_json_body(raw), model)
        return await answer(parsed.api, request, parsed)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        check_model({"model": model_id}, model)
        return model_card()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return tokenize(parse_json_body(await limits.read_body(request, gateway.limits.max_request_body_bytes)), model)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return detokenize(parse_json_body(await limits.read_body(request, gateway.limits.max_request_body_bytes)),
                          model)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/health")
    async def health() -> Response:
        ok, detail = gateway.health_status()
        return JSONResponse({"status": "ok" if ok else "unavailable", "detail": detail},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.observe_decode_pool(gateway.orchestrator.decode_workers())
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _unless_disconnected(request: Request, work: Awaitable[T], poll_s: float = 0.25) -> T | None:
    """Awaits work, cancelling it if the HTTP client disconnects first (then returns None)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                # Cancel until it takes: on Python 3.11 asyncio.wait_for can swallow a
                # cancellation that races with its inner result.
                while not task.done():
                    task.cancel()
                    await asyncio.wait({task}, timeout=0.05)
                with contextlib.suppress(asyncio.CancelledError):
                    task.result()
                return None
    finally:
        if not task.done():
            task.cancel()
