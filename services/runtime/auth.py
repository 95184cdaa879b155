"""API keys: one check, in front of the gateway's REST app and its gRPC Generation service.

    REST   Authorization: Bearer KEY        every route but the open ones (GET /health, and
                                            GET /metrics unless --metrics-auth)
    gRPC   metadata authorization: Bearer KEY   every tandem.v1.Generation method (grpc.health.v1
                                            and reflection stay open, like /health)

A missing, malformed or unknown key gets 401 with an OpenAI-shaped body (code invalid_api_key),
or gRPC UNAUTHENTICATED, before the request reaches a handler: handlers and servicers never read
headers. Keys are compared in constant time: every presented key is hashed and compared with
every configured key's hash (hmac.compare_digest), so neither the position nor a prefix of a
match shows in the timing. The scheme word "Bearer" is case-insensitive (RFC 7235); keys are not.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.runtime.settings import SettingsError

GENERATION_SERVICE = "tandem.v1.Generation"
INVALID_KEY_MESSAGE = "Incorrect or missing API key: send 'Authorization: Bearer <key>'."
UNAUTHORIZED_BODY = json.dumps({"error": {"message": INVALID_KEY_MESSAGE, "type": "invalid_request_error",
                                          "param": None, "code": "invalid_api_key"}}).encode()  # fmt: skip


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def read_key_file(path: str | Path) -> list[str]:
    """Keys in a file, one per line; blank lines and `#` comments are skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys (as SHA-256 digests: the plain keys are not kept)."""

    digests: tuple[bytes, ...]

    @classmethod
    def of(cls, keys: Iterable[str]) -> ApiKeys:
        return cls(tuple(_digest(k) for k in dict.fromkeys(keys)))

    @classmethod
    def from_settings(cls, settings: Any) -> ApiKeys:
        """A GatewaySettings' --api-key values plus --api-key-file's (SettingsError naming the file)."""
        keys = list(settings.api_keys)
        if settings.api_key_file:
            try:
                keys += read_key_file(settings.api_key_file)
            except (OSError, UnicodeDecodeError) as exc:
                raise SettingsError(f"--api-key-file {settings.api_key_file!r}: {exc}") from None
        return cls.of(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def accepts(self, key: str | None) -> bool:
        if key is None:
            return False
        presented = _digest(key)
        match = False
        for digest in self.digests:  # no early exit: the time does not depend on which key matched
            match |= hmac.compare_digest(presented, digest)
        return match

    def accepts_header(self, value: str | None) -> bool:
        """An Authorization header (or gRPC metadata) value: 'Bearer KEY'."""
        scheme, _, key = (value or "").strip().partition(" ")
        return scheme.lower() == "bearer" and self.accepts(key.strip() or None)


# -- REST: a pure ASGI middleware (below FastAPI, so no route can be forgotten) -----------------
class ApiKeyMiddleware:
    """Answers 401 to every HTTP request without a valid key, except on `open_paths`."""

    def __init__(self, app: Callable[..., Awaitable[None]], keys: ApiKeys, open_paths: Sequence[str]) -> None:
        self.app = app
        self.keys = keys
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.open_paths or not self.keys.enabled:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.keys.accepts_header(header.decode("latin-1") if header is not None else None):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(UNAUTHORIZED_BODY)).encode()),
            (b"www-authenticate", b'Bearer realm="tandem"')]})  # fmt: skip
        await send({"type": "http.response.body", "body": UNAUTHORIZED_BODY})


def rest_open_paths(metrics_auth: bool) -> tuple[str, ...]:
    return ("/health",) if metrics_auth else ("/health", "/metrics")


# -- gRPC: one server interceptor --------------------------------------------------------------
def _unauthenticated_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, INVALID_KEY_MESSAGE)

    codec = {"request_deserializer": handler.request_deserializer,
             "response_serializer": handler.response_serializer}  # fmt: skip
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, **codec)
    return grpc.stream_stream_rpc_method_handler(abort, **codec)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Checks the `authorization` metadata of every call to the `services` (full names)."""

    def __init__(self, keys: ApiKeys, services: Sequence[str] = (GENERATION_SERVICE,)) -> None:
        self.keys = keys
        self.prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not self.keys.enabled or not details.method.startswith(self.prefixes):
            return handler
        metadata = dict(details.invocation_metadata or ())
        value = metadata.get("authorization")
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if self.keys.accepts_header(value):
            return handler
        return _unauthenticated_handler(handler)
