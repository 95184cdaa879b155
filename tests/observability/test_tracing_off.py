"""Tracing is off unless OTEL_* asks for it, and off costs nothing: no SDK provider, no exporter
thread, a no-op span, no metadata. On (in a fresh process), the batch exporter thread exists and
both OTLP protocols are accepted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys, threading
from opentelemetry import trace
from services.runtime import tracing
on = tracing.setup_tracing("decode")
span = tracing.start_span("x")
print(json.dumps({
    "on": on, "enabled": tracing.enabled(),
    "provider": type(trace.get_tracer_provider()).__module__,
    "threads": sorted(t.name for t in threading.enumerate()),
    "sdk_loaded": "opentelemetry.sdk.trace" in sys.modules,
    "recording": span.is_recording(),
    "metadata": tracing.grpc_metadata(tracing.context_of(span)),
}))
"""


def run_probe(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_by_default_costs_nothing() -> None:
    got = run_probe({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "x"})  # no endpoint: off
    assert got["on"] is False and got["enabled"] is False
    assert not got["sdk_loaded"], "the SDK must not even be imported when tracing is off"
    assert got["provider"].startswith("opentelemetry.trace")  # the API's proxy / no-op provider
    assert not any("Otel" in t or "BatchSpan" in t for t in got["threads"]), got["threads"]
    assert got["recording"] is False and got["metadata"] is None


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_on_with_an_endpoint(protocol: str) -> None:
    got = run_probe({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
    assert got["on"] and got["enabled"] and got["sdk_loaded"] and got["recording"]
    assert any(t.startswith("OtelBatchSpan") for t in got["threads"]), got["threads"]
    assert got["metadata"][0][0] == "traceparent"


def test_a_bad_protocol_is_a_clear_error() -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env = {**clean, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}
    out = subprocess.run([sys.executable, "-m", "services.cli", "decode", "--model", "/nonexistent"], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "OTEL_EXPORTER_OTLP_PROTOCOL='thrift'" in out.stderr, out.stderr
