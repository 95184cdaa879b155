"""The cluster every test of this folder shares is really secure (issue 11, acceptance 4): the
helpers pass because they present the key and the client certificate, not because nothing is
checked. Against that same cluster: REST without a key, with a wrong or a case-changed key is
401 and plain HTTP to its HTTPS port gets no answer; gRPC Generation without the key is
UNAUTHENTICATED; every service's gRPC port (gateway, prefill, both decodes) refuses plaintext
clients, and every worker refuses a client whose certificate another CA signed."""

from __future__ import annotations

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher.cluster import Cluster
from services.runtime import certs
from services.runtime.tls import Dialer, TlsIdentity
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster.cluster_helpers import API_KEY, gateway_channel, get, worker_channel

WRONG_KEYS = {"missing": None, "wrong": "sk-tandem-not-a-key", "case-changed": API_KEY.swapcase()}


def test_the_shared_cluster_is_secure(disagg: Cluster) -> None:
    assert disagg.spec.api_keys == (API_KEY,) and disagg.spec.tls_dir
    assert disagg.http_url.startswith("https://")
    assert all(p.probe_tls is not None for p in disagg.processes)  # the helpers reach every port over TLS
    assert get(disagg, "/v1/models").status_code == 200  # with the key


@pytest.mark.parametrize("route", ["/v1/models", "/v1/completions"])
@pytest.mark.parametrize("key", list(WRONG_KEYS), ids=list(WRONG_KEYS))
def test_rest_without_the_right_key_is_401(disagg: Cluster, route: str, key: str) -> None:
    verify = disagg.gateway.probe_tls.client_ssl_context()
    headers = {"Authorization": f"Bearer {WRONG_KEYS[key]}"} if WRONG_KEYS[key] else {}
    body = {"prompt": [10, 11, 12], "max_tokens": 2}
    with httpx.Client(base_url=disagg.http_url, verify=verify, headers=headers, timeout=30) as client:
        reply = client.post(route, json=body) if route == "/v1/completions" else client.get(route)
    assert reply.status_code == 401, reply.text
    assert reply.json()["error"]["code"] == "invalid_api_key"


def test_plain_http_to_the_https_port_gets_no_answer(disagg: Cluster) -> None:
    plain = "http://" + disagg.http_url.removeprefix("https://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", timeout=30).raise_for_status()


def test_grpc_generation_without_the_key_is_unauthenticated(disagg: Cluster) -> None:
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[10, 11, 12]), return_token_ids=True,
                                             sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
    with Dialer(disagg.gateway.probe_tls).channel(disagg.grpc_address, "gateway") as channel:
        with pytest.raises(grpc.RpcError) as info:
            generation_pb2_grpc.GenerationStub(channel).Complete(request, timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with gateway_channel(disagg) as channel:  # the helpers' channel: TLS and the key
        assert len(generation_pb2_grpc.GenerationStub(channel).Complete(request, timeout=120).choices[0].token_ids) == 2


def _health(channel: grpc.Channel) -> None:
    with channel:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=60)


def test_every_grpc_port_refuses_plaintext_and_workers_refuse_wrong_ca_clients(disagg: Cluster, tmp_path) -> None:
    # A stranger that trusts the cluster's CA (so only the server's check can stop it) but holds a
    # certificate another CA signed.
    other = certs.files(certs.write_certs(tmp_path / "other", ca_name="Some other CA"), certs.CLIENT)
    stranger = Dialer(TlsIdentity.load(other.cert, other.key, certs.files(str(disagg.spec.tls_dir), certs.CLIENT).ca))
    for process in disagg.processes:
        _health(worker_channel(process))  # the cluster's client certificate is let in
        with pytest.raises(grpc.RpcError) as info:
            _health(grpc.insecure_channel(process.grpc_address))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, process.name
        if process.role == "gateway":
            continue  # its public port asks no client certificate (--public-tls tls): keys authenticate
        with pytest.raises(grpc.RpcError) as info:
            _health(stranger.channel(process.grpc_address, process.role))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, process.name
