"""`tandem certs`: a development CA and one certificate per service, for mTLS between services.

    tandem certs --out certs/ [--namespace tandem] [--days 365]
      ca.crt ca.key                          the cluster's CA (keep ca.key off the servers)
      gateway.crt/.key prefill.crt/.key      one per service: serverAuth + clientAuth, SANs
      decode.crt/.key  draft.crt/.key          tandem-<role> (checked by peers, services/runtime/tls.py),
                                               localhost, 127.0.0.1, ::1 and the k8s Service names
                                               tandem-<role>[.<ns>[.svc[.cluster.local]]]
      client.crt/.key                        clientAuth only: probes, tests, operators' tools

Then e.g. `tandem decode --tls-cert certs/decode.crt --tls-key certs/decode.key --tls-ca certs/ca.crt`,
or `tandem up --tls-dir certs/` for a whole local cluster. Keys are ECDSA P-256, written 0600.
For production use your own CA or cert-manager (k8s/components/mtls).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.runtime.tls import ROLES, peer_name

CLIENT = "client"
DEFAULT_NAMESPACES = ("tandem", "tandem-dev")  # the k8s overlays' namespaces
LOOPBACK_IPS = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class CertFiles:
    """Where `tandem certs` put one identity's files."""

    cert: Path
    key: Path
    ca: Path


def service_dns_names(role: str, namespaces: Sequence[str]) -> list[str]:
    name = peer_name(role)
    names = [name, "localhost"]
    for ns in namespaces:
        names += [f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]
    return names


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem (development)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    # Backdated an hour: a peer whose clock is a little behind must not see "not yet valid".
    return builder.not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=days))


def make_ca(common_name: str = "Tandem development CA", days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    builder = _validity(x509.CertificateBuilder(), days).subject_name(_name(common_name)).issuer_name(_name(common_name))
    builder = (builder.public_key(key.public_key()).serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))  # fmt: skip
    return builder.sign(key, hashes.SHA256()), key


def make_leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, dns_names: Sequence[str],
              ip_addresses: Sequence[str], *, server: bool, days: int = 365,
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:  # fmt: skip
    """A certificate signed by `ca`: clientAuth, plus serverAuth when `server`."""
    key = _key()
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
    builder = _validity(x509.CertificateBuilder(), days).subject_name(_name(common_name)).issuer_name(ca.subject)
    builder = (builder.public_key(key.public_key()).serial_number(x509.random_serial_number())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.SubjectAlternativeName(sans), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))  # fmt: skip
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, private: bool) -> None:
    if private:  # created 0600, never world-readable even for an instant
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    else:
        path.write_bytes(data)


def _save(out: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    _write(out / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), private=False)
    _write(out / f"{name}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()), private=True)  # fmt: skip


def write_certs(out: str | Path, namespaces: Sequence[str] = DEFAULT_NAMESPACES, days: int = 365,
                ca_name: str = "Tandem development CA") -> Path:  # fmt: skip
    """Write ca.*, <role>.* for every service and client.* into `out` (created); returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(ca_name, days)
    _save(out, "ca", ca, ca_key)
    for role in ROLES:
        cert, key = make_leaf(ca, ca_key, peer_name(role), service_dns_names(role, namespaces), LOOPBACK_IPS,
                              server=True, days=days)  # fmt: skip
        _save(out, role, cert, key)
    cert, key = make_leaf(ca, ca_key, f"tandem-{CLIENT}", [f"tandem-{CLIENT}"], [], server=False, days=days)
    _save(out, CLIENT, cert, key)
    return out


def files(directory: str | Path, name: str) -> CertFiles:
    """The files of `name` (a role or "client") in a `tandem certs` folder."""
    directory = Path(directory)
    return CertFiles(directory / f"{name}.crt", directory / f"{name}.key", directory / "ca.crt")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem certs", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))  # fmt: skip
    parser.add_argument("--out", required=True, help="folder to write into (created)")
    parser.add_argument("--namespace", action="append", default=None,
                        help=f"k8s namespace for the Service DNS SANs (repeatable; default {', '.join(DEFAULT_NAMESPACES)})")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing CA in --out")
    args = parser.parse_args(argv)
    if args.days < 1:
        parser.error(f"--days {args.days}: must be >= 1")
    if (Path(args.out) / "ca.crt").exists() and not args.force:
        print(f"tandem certs: {args.out}/ca.crt exists (use --force to replace the whole set)", file=sys.stderr)
        return 1
    out = write_certs(args.out, args.namespace or DEFAULT_NAMESPACES, args.days)
    names = ", ".join(["ca", *ROLES, CLIENT])
    print(f"tandem certs: wrote {names} (.crt/.key) to {out}/", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
