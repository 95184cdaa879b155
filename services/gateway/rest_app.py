"""The OpenAI-compatible REST API (FastAPI): thin handlers over parse -> orchestrator -> shape.

    POST /v1/completions, /v1/chat/completions   (stream: SSE `data: {...}` ... `data: [DONE]`)
    GET  /v1/models, /health, /metrics, /openapi.json

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

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.gateway import limits
from services.gateway.errors import GatewayError, NotFound
from services.gateway.openapi import install_openapi, openapi_route
from services.gateway.openai_schemas import (ApiRequest, ChunkWriter, full_response, parse_chat,
                                             parse_completion, parse_json_body)
from services.gateway.request_types import GenerationUpdate, collect
from services.runtime import tracing

T = TypeVar("T")

logger = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for disconnects and always closes its generator
    (shielded), so the request's aborts run even when the client vanished while we waited."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


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

    async def generate(request: Request, parse) -> Response:
        raw = await limits.read_body(request, gateway.limits.max_request_body_bytes)
        api: ApiRequest = parse(parse_json_body(raw), model)
        api.generation = limits.check_request(api.generation, model, gateway.limits, gateway.kv_capacity())
        updates = gateway.orchestrator.generate(
            api.generation, trace_parent=tracing.context_from_headers(request.headers),
            span_name=f"POST {request.url.path}")
        if not api.stream:
            async def gather() -> list[GenerationUpdate]:
                async with contextlib.aclosing(updates):
                    return [u async for u in updates]

            got = await _unless_disconnected(request, gather())
            if got is None:  # the client left: cancelling closed the updates, which aborts the request
                return Response(status_code=499)
            results, usage = collect(got, api.generation.params.n)
            return JSONResponse(full_response(api, model, results, usage))
        try:
            first = await anext(updates)  # routing and admission errors become real statuses
        except BaseException:
            await updates.aclose()
            raise
        return SSEResponse(_sse(api, first, updates))

    async def _sse(api: ApiRequest, first: GenerationUpdate, updates: AsyncIterator[GenerationUpdate]):
        writer = ChunkWriter(api, model)
        usage = None
        try:
            update = first
            while True:
                if update.choices:
                    yield writer.update(update.choices)
                usage = update.usage or usage
                try:
                    update = await anext(updates)
                except StopAsyncIteration:
                    break
            yield writer.finish(usage)
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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model.name, "object": "model", "created": model.created, "owned_by": "tandem",
            "max_model_len": model.max_model_len,
        }]}

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
