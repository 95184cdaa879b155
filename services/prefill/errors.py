"""Why a prefill request failed, and the one place that maps it to a gRPC status."""

from __future__ import annotations

import enum

import grpc


class FailureKind(enum.Enum):
    INVALID = "invalid"  # bad input from the gateway: INVALID_ARGUMENT naming the field
    INCOMPATIBLE = "incompatible"  # KV layouts differ: FAILED_PRECONDITION naming each field
    RESERVATION_GONE = "reservation_gone"  # decode no longer holds the reservation
    LEASE_EXPIRED = "lease_expired"  # could not start pushing before the lease deadline
    CORRUPT = "corrupt"  # decode rejected a piece's checksum
    TRANSPORT = "transport"  # decode unreachable / the PushKV stream broke
    ABORTED = "aborted"  # Abort rpc or the caller cancelled
    UNAVAILABLE = "unavailable"  # draining
    INTERNAL = "internal"  # a piece decode calls malformed, or an engine failure


_STATUS: dict[FailureKind, grpc.StatusCode] = {
    FailureKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    FailureKind.INCOMPATIBLE: grpc.StatusCode.FAILED_PRECONDITION,
    FailureKind.RESERVATION_GONE: grpc.StatusCode.FAILED_PRECONDITION,
    FailureKind.LEASE_EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    FailureKind.CORRUPT: grpc.StatusCode.DATA_LOSS,
    FailureKind.TRANSPORT: grpc.StatusCode.UNAVAILABLE,
    FailureKind.ABORTED: grpc.StatusCode.CANCELLED,
    FailureKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    FailureKind.INTERNAL: grpc.StatusCode.INTERNAL,
}

# tandem_kv_transfer_failures_total{reason} (docs/deployment.md lists the label values).
_METRIC_REASON: dict[FailureKind, str] = {
    FailureKind.INCOMPATIBLE: "incompatible",
    FailureKind.RESERVATION_GONE: "expired",
    FailureKind.LEASE_EXPIRED: "timeout",
    FailureKind.CORRUPT: "checksum",
    FailureKind.TRANSPORT: "transport",
    FailureKind.INTERNAL: "transport",
}


class PrefillError(Exception):
    """One request failed; the message is what the caller reads (it names the field or peer)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def status_code(self) -> grpc.StatusCode:
        return _STATUS[self.kind]

    @property
    def metric_reason(self) -> str | None:
        """The kv_transfer_failures reason label, or None when no transfer failed."""
        return _METRIC_REASON.get(self.kind)


def invalid(field: str, message: str) -> PrefillError:
    return PrefillError(FailureKind.INVALID, f"{field}: {message}")
