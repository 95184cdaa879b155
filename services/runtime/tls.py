"""TLS and mTLS for every Tandem connection: server credentials, client channels, HTTPS contexts.

One certificate per service, one CA per cluster (`tandem certs` makes them; cert-manager in k8s):

    gateway ──mTLS──> prefill ──mTLS (KVTransfer)──> decode ──mTLS──> draft
       └──────────────mTLS──────────────────────────────^
    a worker's server requires a client certificate signed by --tls-ca: plaintext and
    wrong-CA clients fail the handshake before any RPC runs.

Who is who: workers register their pod IP (or 127.0.0.1) in Redis, and one Certificate serves
every replica of a Deployment, so a certificate cannot name the address a peer dials. A client
therefore checks the *role* instead: it verifies the server's certificate against the CA and
against the name `tandem-<role>` (gRPC's target-name override), which `tandem certs` and the k8s
Certificates put in each service's SANs beside localhost, 127.0.0.1 and the Service DNS names.

Without --tls-cert everything stays plaintext (a private network, or a service mesh doing mTLS).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.runtime.settings import SettingsError

ROLES: tuple[str, ...] = ("gateway", "prefill", "decode", "draft")


class TlsError(SettingsError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


def peer_name(role: str) -> str:
    """The SAN a service of `role` must carry, checked by every client that dials one."""
    return f"tandem-{role}"


@dataclass(frozen=True)
class TlsIdentity:
    """One service's certificate chain and key, and the CA its peers must be signed by (PEM)."""

    cert_path: str
    key_path: str
    ca_path: str
    cert_chain: bytes
    private_key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str | Path, key: str | Path, ca: str | Path) -> TlsIdentity:
        data = {}
        for name, path in (("cert", cert), ("key", key), ("ca", ca)):
            try:
                data[name] = Path(path).read_bytes()
            except OSError as exc:
                raise TlsError(f"--tls-{name} {str(path)!r}: {exc.strerror or exc}") from None
            if b"-----BEGIN " not in data[name]:
                raise TlsError(f"--tls-{name} {str(path)!r}: not a PEM file")
        identity = cls(str(cert), str(key), str(ca), data["cert"], data["key"], data["ca"])
        identity.client_ssl_context()  # fail now if the key does not match the certificate
        return identity

    @classmethod
    def from_settings(cls, common: Any) -> TlsIdentity | None:
        """The identity of a service's CommonSettings (--tls-cert/--tls-key/--tls-ca), or None."""
        if not common.tls_enabled:
            return None
        return cls.load(common.tls_cert, common.tls_key, common.tls_ca)

    # -- gRPC -----------------------------------------------------------------------------------
    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """Server side: our certificate; with require_client_cert (workers), mTLS."""
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: verify the server against our CA and present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)  # fmt: skip

    # -- HTTPS ----------------------------------------------------------------------------------
    def client_ssl_context(self) -> ssl.SSLContext:
        """A client's ssl context (HTTPS probes and tests): verify against our CA, present our cert."""
        context = ssl.create_default_context(cadata=self.ca.decode("ascii", "replace"))
        try:
            context.load_cert_chain(self.cert_path, self.key_path)
        except (ssl.SSLError, OSError) as exc:
            raise TlsError(f"--tls-cert {self.cert_path!r} / --tls-key {self.key_path!r}: {exc}") from None
        return context

    def uvicorn_config(self, require_client_cert: bool) -> dict[str, Any]:
        """uvicorn.Config keyword arguments for HTTPS with this identity."""
        return {"ssl_certfile": self.cert_path, "ssl_keyfile": self.key_path, "ssl_ca_certs": self.ca_path,
                "ssl_cert_reqs": ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE}  # fmt: skip


def server_credentials(identity: TlsIdentity | None, require_client_cert: bool = True) -> grpc.ServerCredentials | None:
    """A GrpcServer's credentials: None (plaintext) without an identity."""
    return None if identity is None else identity.server_credentials(require_client_cert)


class Dialer:
    """Opens the channels one service uses to reach others: mTLS with `identity`, else plaintext.

    `role` is the role of the service dialled; its certificate must carry `peer_name(role)`
    (None: the certificate must name the address dialled, as for any TLS client).
    """

    def __init__(self, identity: TlsIdentity | None = None) -> None:
        self.identity = identity
        self._credentials = identity.channel_credentials() if identity is not None else None

    @property
    def secure(self) -> bool:
        return self.identity is not None

    def _options(self, role: str | None, options: list[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
        extra = [("grpc.ssl_target_name_override", peer_name(role))] if self.secure and role else []
        return [*(options or []), *extra]

    def aio_channel(self, address: str, role: str, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Channel:
        if self._credentials is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self._credentials, options=self._options(role, options))

    def channel(self, address: str, role: str | None, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A blocking channel (decode's draft client runs on the engine thread; probes)."""
        if self._credentials is None:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._credentials, options=self._options(role, options))


PLAINTEXT = Dialer()
