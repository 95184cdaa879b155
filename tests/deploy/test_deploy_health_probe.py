"""services/runtime/health_probe.py against a real gRPC health server and a real HTTP server."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.runtime import health_probe


@pytest.fixture
def grpc_health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_grpc_serving_and_not_serving(grpc_health_server):
    servicer, address = grpc_health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert health_probe.main(["grpc", address, "--timeout", "2"]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_probe.main(["grpc", address, "--timeout", "2"]) == 1
    assert health_probe.main(["grpc", address, "--service", "tandem.v1.Nope", "--timeout", "2"]) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_grpc_unreachable_fails_fast():
    start = time.monotonic()
    assert health_probe.main(["grpc", f"127.0.0.1:{_free_port()}", "--timeout", "2"]) == 1
    assert time.monotonic() - start < 5


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/health" else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_http_probe():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert health_probe.main(["http", f"{base}/health", "--timeout", "2"]) == 0
        assert health_probe.main(["http", f"{base}/other", "--timeout", "2"]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert health_probe.main(["http", f"http://127.0.0.1:{_free_port()}/health", "--timeout", "1"]) == 1
