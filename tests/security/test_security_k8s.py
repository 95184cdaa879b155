"""k8s/components/mtls, rendered offline like the rest of tests/deploy: cert-manager's Issuers and
Certificates (no schema is shipped for them, so their required fields are checked here), every
service's Secret mounted and its TANDEM_TLS_* set, and no kubelet gRPC probe left (it cannot
present a client certificate). The settings each pod would parse are those `tandem` accepts."""

from __future__ import annotations

import pytest

from services.runtime import settings as S
from services.runtime.tls import ROLES, peer_name
from tests.deploy.deploy_files import rendered

OVERLAYS = ("overlays/cpu-dev", "overlays/gpu")
MOUNT = "/etc/tandem/tls"


def _by_kind(resources, kind):
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


@pytest.mark.parametrize("name", OVERLAYS)
def test_cert_manager_chain_is_complete(name):
    resources = rendered(name)
    issuers, certificates = _by_kind(resources, "Issuer"), _by_kind(resources, "Certificate")
    namespace = _by_kind(resources, "Deployment")["tandem-decode"]["metadata"]["namespace"]
    for resource in [*issuers.values(), *certificates.values()]:
        assert resource["apiVersion"] == "cert-manager.io/v1"
        # An Issuer (not ClusterIssuer) signs only in its own namespace: the pods' one.
        assert resource["metadata"]["namespace"] == namespace
    for issuer in issuers.values():
        assert len(set(issuer["spec"]) & {"selfSigned", "ca", "acme", "vault", "venafi"}) == 1, issuer
    ca_secret = issuers["tandem-ca"]["spec"]["ca"]["secretName"]
    (ca_cert,) = [c for c in certificates.values() if c["spec"]["secretName"] == ca_secret]
    assert ca_cert["spec"]["isCA"] is True
    assert issuers[ca_cert["spec"]["issuerRef"]["name"]]["spec"] == {"selfSigned": {}}
    for certificate in certificates.values():
        spec = certificate["spec"]
        assert spec["secretName"] and spec["issuerRef"]["kind"] == "Issuer"
        assert spec["issuerRef"]["name"] in issuers  # nothing refers to an Issuer that is not there
    for role in ROLES:
        spec = certificates[f"tandem-{role}"]["spec"]
        assert spec["issuerRef"]["name"] == "tandem-ca" and not spec.get("isCA")
        assert peer_name(role) in spec["dnsNames"]  # what every client of this role checks
        assert "127.0.0.1" in spec["ipAddresses"]  # what the in-pod probe dials
        assert {"server auth", "client auth"} <= set(spec["usages"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_service_mounts_its_certificate_and_speaks_tls(name):
    resources = rendered(name)
    certificates = _by_kind(resources, "Certificate")
    deployments = _by_kind(resources, "Deployment")
    for role in ROLES:
        pod = deployments[f"tandem-{role}"]["spec"]["template"]["spec"]
        (container,) = [c for c in pod["containers"] if c["name"] == role]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == certificates[f"tandem-{role}"]["spec"]["secretName"]
        assert volume["secret"]["defaultMode"] == 0o440
        assert {"name": "tls", "mountPath": MOUNT, "readOnly": True} in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["TANDEM_TLS_CERT"], env["TANDEM_TLS_KEY"], env["TANDEM_TLS_CA"]) == (
            f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key", f"{MOUNT}/ca.crt")  # cert-manager's Secret keys
        settings = S.parse_settings(role, ["--model", "/models/default"],
                                    {k: v for k, v in env.items() if k.startswith("TANDEM_TLS_")})
        assert settings.common.tls_enabled
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[probe_name]
            assert "grpc" not in probe, f"{name}: {role} {probe_name}: the kubelet's gRPC probe has no client cert"
            assert len({"exec", "httpGet", "grpc", "tcpSocket"} & set(probe)) == 1
            if "httpGet" in probe:
                assert role == "gateway" and probe["httpGet"]["scheme"] == "HTTPS"
            else:
                assert probe["exec"]["command"][:4] == ["python", "-m", "services.runtime.health_probe", "grpc"]
                assert probe["timeoutSeconds"] >= 5  # a Python start, not a kubelet RPC
    gateway = deployments["tandem-gateway"]["spec"]["template"]["metadata"]["annotations"]
    assert gateway["prometheus.io/scheme"] == "https"


def test_base_stays_plaintext():
    resources = rendered("base")
    assert not _by_kind(resources, "Certificate")
    for deployment in _by_kind(resources, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            assert not any(e["name"].startswith("TANDEM_TLS_") for e in container.get("env", []))
