"""Pure pieces of auth and TLS: settings (flags, env, validation), the key check, `tandem certs`'
certificates, and what `tandem up` passes to each service. No sockets."""

from __future__ import annotations

import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from services.launcher.cluster import ClusterSpec, LaunchError, build_processes
from services.launcher.up import spec_from_args
from services.runtime import certs
from services.runtime import settings as S
from services.runtime.auth import ApiKeys, read_key_file
from services.runtime.tls import TlsError, TlsIdentity


def test_api_keys_from_flags_env_and_repr_hides_them():
    parsed = S.parse_settings("gateway", ["--model", "m", "--api-key", "k1", "--api-key", "k2"],
                              {"TANDEM_API_KEYS": "e1,e2"})
    assert parsed.api_keys == ("k1", "k2")  # flags beat env
    assert S.parse_settings("gateway", ["--model", "m"], {"TANDEM_API_KEYS": " e1, e2 ,"}).api_keys == ("e1", "e2")
    assert S.parse_settings("gateway", ["--model", "m"], {}).api_keys == ()
    assert "k1" not in repr(parsed) and "k2" not in repr(parsed)
    assert S.env_vars("gateway")["TANDEM_API_KEYS"].flag == "--api-key"
    assert "TANDEM_API_KEYS" not in S.env_vars("decode")  # keys are the gateway's only


def test_tls_flags_go_together(tmp_path):
    (tmp_path / "a.pem").write_text("x")
    with pytest.raises(S.SettingsError, match="--tls-key.*go together"):
        S.parse_settings("decode", ["--model", "m", "--tls-cert", str(tmp_path / "a.pem")], {})
    with pytest.raises(S.SettingsError, match="--tls-ca.*go together"):
        S.parse_settings("decode", ["--model", "m"], {"TANDEM_TLS_CERT": str(tmp_path / "a.pem"),
                                                      "TANDEM_TLS_KEY": str(tmp_path / "a.pem")})
    with pytest.raises(S.SettingsError, match="--public-tls='mtls'.*needs --tls-cert"):
        S.parse_settings("gateway", ["--model", "m", "--public-tls", "mtls"], {})
    with pytest.raises(S.SettingsError, match="--api-key-file.*none"):  # read when the gateway starts
        ApiKeys.from_settings(S.parse_settings("gateway", ["--model", "m", "--api-key-file", str(tmp_path / "none")], {}))
    with pytest.raises(S.SettingsError, match="TANDEM_API_KEYS.*hidden"):
        S.parse_settings("gateway", ["--model", "m"], {"TANDEM_API_KEYS": "good,bad key\x07"})


def test_tls_identity_names_the_bad_file(tmp_path):
    out = certs.write_certs(tmp_path / "c")
    ok = TlsIdentity.load(out / "decode.crt", out / "decode.key", out / "ca.crt")
    assert ok.cert_chain.startswith(b"-----BEGIN CERTIFICATE")
    with pytest.raises(TlsError, match="--tls-ca.*No such file"):
        TlsIdentity.load(out / "decode.crt", out / "decode.key", tmp_path / "nope.pem")
    with pytest.raises(TlsError, match="--tls-key.*not a PEM"):
        (tmp_path / "junk").write_text("junk")
        TlsIdentity.load(out / "decode.crt", tmp_path / "junk", out / "ca.crt")
    with pytest.raises(TlsError, match="--tls-cert.*--tls-key"):  # key of another certificate
        TlsIdentity.load(out / "decode.crt", out / "prefill.key", out / "ca.crt")


def test_key_check_is_exact():
    keys = ApiKeys.of(["sk-Alpha", "sk-Beta"])
    assert keys.enabled and not ApiKeys.of([]).enabled
    assert keys.accepts_header("Bearer sk-Alpha") and keys.accepts_header("bearer sk-Beta")
    assert keys.accepts_header("  Bearer   sk-Alpha ")
    for bad in (None, "", "Bearer", "Bearer ", "sk-Alpha", "Basic sk-Alpha", "Bearer sk-alpha", "Bearer SK-ALPHA",
                "Bearer sk-Alph", "Bearer sk-Alphaa", "Bearer sk-Alpha sk-Beta", "Bearer sk-Alphask-Beta"):
        assert not keys.accepts_header(bad), bad
    assert b"sk-Alpha" not in repr(keys).encode()


def test_read_key_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# comment\n\nsk-one\n  sk-two  \n#sk-three\n")
    assert read_key_file(path) == ["sk-one", "sk-two"]


def test_tandem_certs_writes_a_ca_and_per_service_certificates(tmp_path):
    out = tmp_path / "certs"
    result = subprocess.run([sys.executable, "-m", "services.cli", "certs", "--out", str(out), "--namespace", "prod"],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for role in ("gateway", "prefill", "decode", "draft"):
        cert = x509.load_pem_x509_certificate((out / f"{role}.crt").read_bytes())
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = sans.get_values_for_type(x509.DNSName)
        assert {f"tandem-{role}", "localhost", f"tandem-{role}.prod.svc.cluster.local"} <= set(dns)
        assert {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert usages == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client = x509.load_pem_x509_certificate((out / "client.crt").read_bytes())
    assert set(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    again = subprocess.run([sys.executable, "-m", "services.cli", "certs", "--out", str(out)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 1 and "--force" in again.stderr  # never replaces a CA by accident


def test_tandem_up_passes_keys_by_env_and_certs_per_role(tiny_model, tmp_path):
    tls_dir = certs.write_certs(tmp_path / "certs")
    spec = ClusterSpec(model=str(tiny_model), api_keys=("sk-a", "sk-b"), tls_dir=str(tls_dir), http_port=0,
                       grpc_port=0)  # fmt: skip
    processes = {p.role: p for p in build_processes(spec, "redis://127.0.0.1:1/0", tmp_path)}
    for role, p in processes.items():
        argv = " ".join(p.argv)
        assert f"--tls-cert {tls_dir}/{role}.crt --tls-key {tls_dir}/{role}.key --tls-ca {tls_dir}/ca.crt" in argv
        assert "sk-a" not in argv and p.probe_tls is not None
    assert processes["gateway"].env["TANDEM_API_KEYS"] == "sk-a,sk-b"
    assert "TANDEM_API_KEYS" not in processes["decode"].env
    assert processes["gateway"].http_url.startswith("https://")
    off = ClusterSpec(model=str(tiny_model), tls_dir=str(tls_dir), extra_args=("--public-tls", "off"))
    gateway = next(p for p in build_processes(off, "redis://127.0.0.1:1/0", tmp_path) if p.role == "gateway")
    assert gateway.http_url.startswith("http://") and gateway.probe_tls is None
    with pytest.raises(LaunchError, match="comma"):
        ClusterSpec(model=str(tiny_model), api_keys=("a,b",))
    parsed = spec_from_args(["--model", str(tiny_model), "--api-key", "sk-a", "--api-key", "sk-b",
                             "--tls-dir", str(tls_dir), "--public-tls", "mtls"])
    assert parsed.api_keys == ("sk-a", "sk-b") and parsed.tls_dir == str(tls_dir)
    assert parsed.extra_args == ("--public-tls", "mtls")  # the keys are not among the pass-through flags
