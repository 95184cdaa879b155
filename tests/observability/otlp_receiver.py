"""A real OTLP/gRPC trace receiver for tests: `opentelemetry.proto`'s TraceService on a free port.

    with OtlpReceiver() as rx:            # rx.endpoint = "http://127.0.0.1:<port>"
        ... services export to it (OTEL_EXPORTER_OTLP_ENDPOINT=rx.endpoint, protocol grpc) ...
        spans = rx.spans(trace_id)        # flattened, with their service.name
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex
    span_id: str  # 16 hex
    parent_span_id: str  # "" for a root
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[tuple[str, str], ...] = ()  # (trace_id, span_id)


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[ReceivedSpan], lock: threading.Lock) -> None:
        self.sink, self.lock = sink, lock

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        got = []
        for rs in request.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(), kind=s.kind, start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano, attributes=_attrs(s.attributes),
                        links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in s.links),
                    ))  # fmt: skip
        with self.lock:
            self.sink.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._spans, self._lock), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]
