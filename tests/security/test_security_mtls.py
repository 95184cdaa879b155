"""mTLS between services (Acceptance 4): every worker and the gateway's gRPC port refuse plaintext,
certificate-less and wrong-CA clients; the right client gets through; and a disaggregated request
with speculation crosses every internal channel (gateway -> prefill/decode, prefill -> decode
KVTransfer, decode -> draft) over mTLS. Real certificates from `tandem certs`, real servers."""

from __future__ import annotations

import json
import ssl
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.runtime.health_probe import check_grpc, check_http
from services.runtime.tls import Dialer, peer_name
from tests.security.conftest import API_KEYS, identity
from tests.services.gateway_helpers import MODEL_NAME

ROLES = ("draft", "decode", "prefill", "gateway")
# Generous: a refusal must come from the handshake (UNAVAILABLE), never from a deadline.
RPC_TIMEOUT_S = 60.0


def _health(channel: grpc.Channel) -> grpc.StatusCode | int:
    """The health status (SERVING = 1), or the gRPC code of the failure."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S).status
    except grpc.RpcError as exc:
        return exc.code()


def _wait_ready(stack, dev_certs) -> None:
    client = identity(dev_certs, "client")
    for _ in range(600):
        if check_http(stack.https_url + "/health", timeout=RPC_TIMEOUT_S, tls=client)[0]:
            return
        time.sleep(0.1)
    raise AssertionError("the TLS gateway never became healthy")


@pytest.mark.parametrize("role", ROLES)
def test_every_server_refuses_plaintext_certless_and_wrong_ca(secure_stack, dev_certs, other_certs, role):
    address = secure_stack.workers[role]
    override = [("grpc.ssl_target_name_override", peer_name(role))]
    # The right client certificate: served.
    with Dialer(identity(dev_certs, "client")).channel(address, role) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    # Plaintext: refused.
    with grpc.insecure_channel(address) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE
    # TLS that trusts the right CA but presents no certificate: refused (client auth is required).
    creds = grpc.ssl_channel_credentials(root_certificates=identity(dev_certs, "client").ca)
    with grpc.secure_channel(address, creds, options=override) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE
    # A client certificate of another CA (the client trusts our CA, so only the server can refuse).
    wrong = identity(other_certs, "client")
    creds = grpc.ssl_channel_credentials(root_certificates=identity(dev_certs, "client").ca,
                                         private_key=wrong.private_key, certificate_chain=wrong.cert_chain)
    with grpc.secure_channel(address, creds, options=override) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE
    # A client of the other cluster entirely (it cannot verify our server either).
    with Dialer(wrong).channel(address, role) as channel:
        assert _health(channel) == grpc.StatusCode.UNAVAILABLE


def test_a_service_certificate_of_another_role_is_not_accepted_as_this_role(secure_stack, dev_certs):
    # Clients check the role SAN, not the address (workers register pod IPs): a decode address
    # dialled as "prefill" fails, because decode's certificate names tandem-decode only.
    client = identity(dev_certs, "client")
    assert check_grpc(secure_stack.workers["decode"], tls=client, role="decode", timeout=RPC_TIMEOUT_S)[0]
    healthy, reason = check_grpc(secure_stack.workers["decode"], tls=client, role="prefill", timeout=RPC_TIMEOUT_S)
    assert not healthy and "UNAVAILABLE" in reason


def _ssl(ca_dir, cert_dir=None) -> ssl.SSLContext:
    """A client context trusting ca_dir's CA, presenting cert_dir's client certificate (if any)."""
    context = ssl.create_default_context(cafile=str(ca_dir / "ca.crt"))
    if cert_dir is not None:
        context.load_cert_chain(str(cert_dir / "client.crt"), str(cert_dir / "client.key"))
    return context


def test_https_gateway_refuses_plaintext_and_wrong_ca(secure_stack, dev_certs, other_certs):
    _wait_ready(secure_stack, dev_certs)
    url = secure_stack.https_url + "/health"
    assert httpx.get(url, verify=_ssl(dev_certs, dev_certs), timeout=RPC_TIMEOUT_S).status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
        httpx.get(url.replace("https://", "http://"), timeout=RPC_TIMEOUT_S)
    with pytest.raises(httpx.HTTPError):  # --public-tls mtls: no client certificate
        httpx.get(url, verify=_ssl(dev_certs), timeout=RPC_TIMEOUT_S)
    with pytest.raises(httpx.HTTPError):  # a client certificate of another CA
        httpx.get(url, verify=_ssl(dev_certs, other_certs), timeout=RPC_TIMEOUT_S)
    with pytest.raises(httpx.HTTPError):  # a client that trusts another CA
        httpx.get(url, verify=_ssl(other_certs, dev_certs), timeout=RPC_TIMEOUT_S)


def test_disaggregated_speculative_request_over_mtls(secure_stack, dev_certs):
    """gateway -> prefill -> (KVTransfer) decode -> draft, all over mTLS; streamed and not."""
    _wait_ready(secure_stack, dev_certs)
    headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
    prefill_before = secure_stack.prefill.metrics.prefill_tokens._value.get()
    drafted_before = secure_stack.decode.metrics.spec_draft._value.get()
    body = {"model": MODEL_NAME, "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(verify=_ssl(dev_certs, dev_certs), headers=headers, timeout=RPC_TIMEOUT_S) as http:
        full = http.post(secure_stack.https_url + "/v1/completions", json=body)
        assert full.status_code == 200, full.text
        assert full.json()["usage"]["completion_tokens"] == 10
        events = []
        with http.stream("POST", secure_stack.https_url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
    assert text == full.json()["choices"][0]["text"]
    # Prefill computed the prompt (so it pushed KV to decode over mTLS), and decode drafted.
    assert secure_stack.prefill.metrics.prefill_tokens._value.get() > prefill_before
    assert secure_stack.decode.metrics.spec_draft._value.get() > drafted_before
