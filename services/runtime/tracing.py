"""OpenTelemetry tracing for every Tandem service, configured only by the standard OTEL_* variables.

Off unless `settings.tracing_enabled(os.environ)` (OTEL_EXPORTER_OTLP_ENDPOINT, ..._TRACES_ENDPOINT
or OTEL_TRACES_EXPORTER set). Off costs nothing: no SDK provider is installed (the API's tracer is
a no-op), no exporter thread starts, `span()` hands back a shared non-recording span without
touching the context, and nothing is injected into gRPC metadata.

One trace per request, across processes (W3C `traceparent` in gRPC metadata / HTTP headers):

    gateway  POST /v1/completions | tandem.v1.Generation/Generate     (parent: client traceparent)
      ├─ gateway.route ── decode.reserve                                  (decode)
      ├─ decode.generate                                                  (decode)
      │    ├─ decode.queue_wait   arrival -> first token on decode (remote: waiting for the KV)
      │    └─ decode.generation   first token -> last token
      │         draft.propose (CLIENT, decode) ── draft.propose (SERVER, draft)   one per batched
      │              call: child of the batch's first traced request, links to every request
      └─ prefill.request                                                  (prefill)
           ├─ prefill.chunk ...   one per engine step that computed prompt tokens
           └─ kv.transfer (CLIENT) ── kv.receive (decode, PushKV)
                └─ kv.send_chunk ... one per computed chunk (bytes)

Spans never start on an engine thread's hot loop: engine work is recorded afterwards from
timestamps (`record_span`). Attributes follow the GenAI semantic conventions where they apply
(`gen_ai.*`), the rest are `tandem.*`; build them only when `span.is_recording()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanContext, SpanKind, Status, StatusCode

from services.runtime.settings import SettingsError, tracing_enabled

logger = logging.getLogger(__name__)

TRACER_NAME = "tandem"
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "grpc"  # opentelemetry-python's default; the compose file and manifests set it

Metadata = tuple[tuple[str, str], ...]

_provider: Any = None  # the SDK TracerProvider once setup_tracing() turned tracing on


def enabled() -> bool:
    return _provider is not None


def setup_tracing(role: str, environ: Mapping[str, str] | None = None) -> bool:
    """Installs the SDK provider + batch OTLP exporter when the environment asks for tracing.

    Call once at process start (each service's main). Returns whether tracing is on. The SDK
    itself reads the rest of OTEL_* (endpoint, headers, sampler, OTEL_BSP_*) from os.environ."""
    global _provider
    environ = os.environ if environ is None else environ
    if _provider is not None or not tracing_enabled(environ):
        return _provider is not None
    # Imported here: with tracing off the SDK is never even loaded.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = environ.get("OTEL_SERVICE_NAME", "").strip() or "service.name=" in environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    resource = Resource.create({} if named else {SERVICE_NAME: f"tandem-{role}"})
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER / _ARG
    exporter = _exporter(environ)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing on: %s, service %s", type(exporter).__name__ if exporter else "no exporter",
                resource.attributes.get(SERVICE_NAME))  # fmt: skip
    return True


def _exporter(environ: Mapping[str, str]):
    kind = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        logger.warning("OTEL_TRACES_EXPORTER=%r is not supported (otlp, console, none); spans are dropped", kind)
        return None
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or DEFAULT_PROTOCOL)  # fmt: skip
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise SettingsError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: must be one of {', '.join(PROTOCOLS)}")
    return OTLPSpanExporter()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_* from os.environ


def shutdown_tracing() -> None:
    """Flushes and stops the exporter (also registered at exit by the SDK)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


# -- spans ---------------------------------------------------------------------------------------
def start_span(name: str, parent: Context | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
               links: Sequence[Link] = (), start_time_ns: int | None = None) -> Span:  # fmt: skip
    """A span with an explicit parent (never the ambient context: our generators and tasks cross
    contexts). End it yourself. Off: the shared INVALID_SPAN, at no cost."""
    if _provider is None:
        return INVALID_SPAN
    return tracer().start_span(name, context=parent or Context(), kind=kind, links=list(links),
                               start_time=start_time_ns)  # fmt: skip


@contextlib.contextmanager
def span(name: str, parent: Context | None = None, *, kind: SpanKind = SpanKind.INTERNAL,
         links: Sequence[Link] = ()) -> Iterator[Span]:
    """start_span + end on exit; an exception marks the span as an error."""
    s = start_span(name, parent, kind=kind, links=links)
    try:
        yield s
    except BaseException as e:
        if s.is_recording():
            mark_error(s, e)
        raise
    finally:
        s.end()


def record_span(name: str, parent: Context | None, start_time_ns: int, end_time_ns: int,
                attributes: Mapping[str, Any] | None = None) -> None:  # fmt: skip
    """A span for work that already happened (engine steps), from its timestamps."""
    if _provider is None:
        return
    s = tracer().start_span(name, context=parent or Context(), start_time=start_time_ns)
    if attributes:
        s.set_attributes(dict(attributes))
    s.end(end_time=max(end_time_ns, start_time_ns))


def context_of(s: Span) -> Context | None:
    """The context whose parent is `s` (for children and for propagation); None when off."""
    if not s.is_recording():
        return None
    return trace.set_span_in_context(s, Context())


def link_to(ctx: SpanContext | None) -> Link | None:
    return Link(ctx) if ctx is not None and ctx.is_valid else None


def mark_error(s: Span, error: BaseException | str) -> None:
    if s.is_recording():
        s.set_status(Status(StatusCode.ERROR, str(error)[:200]))
        if isinstance(error, BaseException) and not isinstance(error, (GeneratorExit,)):
            s.record_exception(error)


def set_attributes(s: Span, attributes: Mapping[str, Any]) -> None:
    """Sets the non-None ones (OTel refuses None values)."""
    if s.is_recording():
        s.set_attributes({k: v for k, v in attributes.items() if v is not None})


def now_ns() -> int:
    return time.time_ns()


# -- propagation ---------------------------------------------------------------------------------
def grpc_metadata(parent: Context | None) -> Metadata | None:
    """Outgoing gRPC metadata carrying `parent` (W3C traceparent); None when there is nothing."""
    if _provider is None or parent is None:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=parent)
    return tuple(carrier.items()) or None


def context_from_grpc(servicer_context: Any) -> Context | None:
    """The caller's trace context from an incoming call's metadata; None when off or absent."""
    if _provider is None:
        return None
    metadata = servicer_context.invocation_metadata() or ()
    carrier = {k: v for k, v in metadata if isinstance(v, str)}
    return propagate.extract(carrier, context=Context()) if "traceparent" in carrier else None


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The client's trace context from HTTP headers (`traceparent`, `tracestate`)."""
    if _provider is None or "traceparent" not in headers:
        return None
    return propagate.extract({k.lower(): v for k, v in headers.items()}, context=Context())


def context_from_span_context(sc: SpanContext) -> Context:
    """A context whose parent is the (possibly remote or finished) span `sc`."""
    return trace.set_span_in_context(trace.NonRecordingSpan(sc), Context())


def span_context_of(ctx: Context | None) -> SpanContext | None:
    if ctx is None:
        return None
    sc = trace.get_current_span(ctx).get_span_context()
    return sc if sc.is_valid else None


def genai_request_attributes(model: str, params: Any, num_prompt_tokens: int) -> dict[str, Any]:
    """GenAI semantic-convention attributes of a request (params: common SamplingParams)."""
    return {
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.request.seed": params.seed,
        "gen_ai.request.choice.count": params.n if params.n != 1 else None,
        "gen_ai.usage.input_tokens": num_prompt_tokens,
    }
