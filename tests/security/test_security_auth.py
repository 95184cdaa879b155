"""API keys (Acceptance 4): a missing, wrong or case-changed key gets 401 (OpenAI's error shape,
code invalid_api_key) on every REST route the app serves and UNAUTHENTICATED on every method of
tandem.v1.Generation; GET /health (and /metrics by default) stay open; the right key is served.
The routes and methods are read from the running app and the proto, so none can be forgotten."""

from __future__ import annotations

import re
import ssl

import grpc
import httpx
import pytest
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.auth import ApiKeyMiddleware
from services.runtime.tls import Dialer
from tandem.v1 import generation_pb2
from tests.security.conftest import API_KEYS, LoopThread, identity
from tests.services.gateway_helpers import MODEL_NAME, free_port, gateway_settings, served_model

KEY = API_KEYS[1]
TIMEOUT_S = 60.0
GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]


def bad_authorizations(key: str) -> dict[str, dict[str, str]]:
    """name -> headers a client might send that must all be refused."""
    return {
        "missing": {},
        "empty": {"Authorization": ""},
        "wrong key": {"Authorization": "Bearer sk-not-a-key"},
        "key upper-cased": {"Authorization": f"Bearer {key.upper()}"},
        "key lower-cased": {"Authorization": f"Bearer {key.lower()}"},
        "key case-swapped": {"Authorization": f"Bearer {key.swapcase()}"},
        "key prefix": {"Authorization": f"Bearer {key[:-1]}"},
        "key plus a char": {"Authorization": f"Bearer {key}x"},
        "no scheme": {"Authorization": key},
        "basic scheme": {"Authorization": f"Basic {key}"},
        "two keys glued": {"Authorization": f"Bearer {API_KEYS[0]}{API_KEYS[1]}"},
    }


def app_routes(handle) -> list[tuple[str, str]]:
    """(method, path) of every route of the gateway's running FastAPI app (path parameters filled)."""
    app = handle._http.config.app
    assert isinstance(app, ApiKeyMiddleware)
    routes = []
    for route in app.app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            routes.append((method, re.sub(r"\{[^}]+\}", "x", route.path)))
    assert ("POST", "/v1/completions") in routes and ("GET", "/health") in routes
    return routes


def _client_ssl(dev_certs) -> ssl.SSLContext:
    return identity(dev_certs, "client").client_ssl_context()


def assert_401(response: httpx.Response, what: str) -> None:
    assert response.status_code == 401, f"{what}: {response.status_code} {response.text[:200]}"
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error", what
    assert error["message"] and response.headers["www-authenticate"].startswith("Bearer")


def test_every_rest_route_refuses_bad_keys(secure_stack, dev_certs):
    gateway = secure_stack.gateway
    open_paths = {"/health", "/metrics"}
    routes = app_routes(gateway) + [("GET", "/no/such/route"), ("POST", "/v1/embeddings")]
    with httpx.Client(base_url=secure_stack.https_url, verify=_client_ssl(dev_certs), timeout=TIMEOUT_S) as http:
        for method, path in routes:
            for name, headers in bad_authorizations(KEY).items():
                r = http.request(method, path, headers=headers, json={"model": MODEL_NAME, "prompt": "x"})
                if path in open_paths:
                    assert r.status_code != 401, f"{method} {path} is open, but {name} got 401"
                else:
                    assert_401(r, f"{method} {path} with {name}")
        # The right key (either one; scheme word in any case) passes the check.
        for key, scheme in ((API_KEYS[0], "Bearer"), (API_KEYS[1], "bearer")):
            r = http.get("/v1/models", headers={"Authorization": f"{scheme} {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL_NAME
        r = http.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "temperature": 0,
                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert http.get("/metrics").status_code == 200  # open by default


def _call(channel: grpc.Channel, method, metadata) -> grpc.StatusCode:
    """Call one Generation method with an empty request; the status code it ends with."""
    path = f"/{GENERATION.full_name}/{method.name}"
    request = message_factory.GetMessageClass(method.input_type)()
    codec = {"request_serializer": type(request).SerializeToString,
             "response_deserializer": message_factory.GetMessageClass(method.output_type).FromString}
    try:
        if method.server_streaming:
            list(channel.unary_stream(path, **codec)(request, metadata=metadata, timeout=TIMEOUT_S))
        else:
            channel.unary_unary(path, **codec)(request, metadata=metadata, timeout=TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_generation_method_refuses_bad_keys(secure_stack, dev_certs):
    assert not any(m.client_streaming for m in GENERATION.methods)  # _call sends one request
    address = secure_stack.workers["gateway"]
    with Dialer(identity(dev_certs, "client")).channel(address, "gateway") as channel:
        for method in GENERATION.methods:
            for name, headers in bad_authorizations(KEY).items():
                metadata = [("authorization", headers["Authorization"])] if headers else []
                code = _call(channel, method, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, f"{method.name} with {name}: {code}"
            code = _call(channel, method, [("authorization", f"Bearer {KEY}")])
            assert code != grpc.StatusCode.UNAUTHENTICATED, method.name
        # ListModels with the key really answers; health stays open without one.
        assert _call(channel, GENERATION.methods_by_name["ListModels"], [("authorization", f"Bearer {KEY}")]) \
            == grpc.StatusCode.OK
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def plain_gateway(tiny_model, redis_url, tmp_path):
    """A plaintext gateway with keys from a file and --metrics-auth (no workers needed: the key check
    comes before any handler)."""
    from services.gateway.main import serve

    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nsk-file-one\n\n  sk-file-two  \n")
    settings = gateway_settings(tiny_model, redis_url, "auth-plain", api_keys=("sk-flag",),
                                api_key_file=str(key_file), metrics_auth=True)
    thread = LoopThread("auth-test-loop")
    handle = thread.run(lambda: serve(settings, http_port=0, grpc_port=free_port(), model=served_model(tiny_model)))
    yield f"http://127.0.0.1:{handle.http_port}"
    thread.run(handle.stop)
    thread.close()


def test_key_file_flag_keys_and_metrics_auth(plain_gateway):
    for key in ("sk-flag", "sk-file-one", "sk-file-two"):
        r = httpx.get(plain_gateway + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT_S)
        assert r.status_code == 200, key
    for key in ("# team keys", "sk-file-three"):
        assert_401(httpx.get(plain_gateway + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=TIMEOUT_S), repr(key))  # fmt: skip
    assert_401(httpx.get(plain_gateway + "/metrics", timeout=TIMEOUT_S), "/metrics with --metrics-auth")
    assert httpx.get(plain_gateway + "/metrics", headers={"Authorization": "Bearer sk-flag"},
                     timeout=TIMEOUT_S).status_code == 200
    assert httpx.get(plain_gateway + "/health", timeout=TIMEOUT_S).status_code in (200, 503)  # open
