"""The gateway's errors and their one mapping to HTTP statuses, OpenAI error bodies and gRPC codes.

Every failure a client can see is a `GatewayError`; handlers never build status codes themselves.

    400 invalid_request_error     a bad field (param names it)        INVALID_ARGUMENT
    404 not_found_error           unknown model or route              NOT_FOUND
    413 invalid_request_error     prompt does not fit the context     INVALID_ARGUMENT
                                  or any KV cache; body too large
    422 invalid_request_error     body is not UTF-8 JSON              INVALID_ARGUMENT
    429 rate_limit_error          admission queue full                RESOURCE_EXHAUSTED
    503 service_unavailable       no decode worker / all failed       UNAVAILABLE
    504 timeout_error             request_timeout elapsed             DEADLINE_EXCEEDED
"""

from __future__ import annotations

import logging
import re
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class GatewayError(Exception):
    """A client-visible failure: HTTP status, OpenAI error type/code, gRPC code, named param."""

    http_status = 500
    error_type = "internal_error"
    grpc_code = grpc.StatusCode.INTERNAL
    counted = False  # already in tandem_requests_total (set by whoever counted it)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_openai(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def grpc_details(self) -> str:
        # gRPC has no param slot: the field leads the message ("temperature: must be >= 0").
        if self.param and not self.message.startswith(f"{self.param}:"):
            return f"{self.param}: {self.message}"
        return self.message


class InvalidRequest(GatewayError):
    http_status = 400
    error_type = "invalid_request_error"
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GatewayError):
    http_status = 404
    error_type = "not_found_error"
    grpc_code = grpc.StatusCode.NOT_FOUND


class PromptTooLong(InvalidRequest):
    http_status = 413


class MalformedBody(InvalidRequest):
    """Not UTF-8 or not JSON: 422 (the body cannot be read at all, as opposed to a bad field)."""

    http_status = 422


class Overloaded(GatewayError):
    http_status = 429
    error_type = "rate_limit_error"
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(GatewayError):
    http_status = 503
    error_type = "service_unavailable"
    grpc_code = grpc.StatusCode.UNAVAILABLE


class RequestTimeout(GatewayError):
    http_status = 504
    error_type = "timeout_error"
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED


def split_field(details: str) -> tuple[str | None, str]:
    """'temperature: must be >= 0' -> ('temperature', 'must be >= 0'); services name fields so."""
    head, sep, rest = details.partition(":")
    if sep and head and head.replace("_", "").replace(".", "").isalnum() and " " not in head:
        return head, rest.strip()
    return None, details


# host:port, IPv4 or [IPv6] or a name with a dot: what a worker's message may hold of the inside.
_ADDRESS = re.compile(r"(\[[0-9a-fA-F:.]+\]|\b[\w-]+(\.[\w-]+)+|\blocalhost):\d{2,5}\b")


def scrub_addresses(text: str) -> str:
    """Clients never see internal addresses (they map the cluster for an attacker)."""
    return _ADDRESS.sub("<internal>", text)


def from_worker_status(code: grpc.StatusCode, details: str, worker: str, request_id: str) -> GatewayError:
    """A worker's gRPC failure as the client should see it: a field error passes through (its
    message is about the request); anything else is a generic message with the request id, and
    the worker's address and details go to the log only."""
    param, _ = split_field(details or "")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(scrub_addresses(details), param=param)
    logger.warning("request %s: worker %s answered %s: %s", request_id, worker, code.name, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(f"a decode worker is overloaded; retry later (request {request_id})", code="overloaded")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RequestTimeout(f"a worker timed out (request {request_id})")
    return Unavailable(f"a worker failed ({code.name}); the gateway log has the details under request "
                       f"{request_id}", code="worker_failed")
