"""A tiny health probe for container HEALTHCHECKs and scripts.

    python -m services.runtime.health_probe grpc HOST:PORT [--service NAME] [--timeout S]
        grpc.health.v1 Check (empty service name = whole server); exit 0 only if SERVING.
    python -m services.runtime.health_probe http URL [--timeout S]
        GET URL; exit 0 only on HTTP 200.

Exit codes: 0 healthy, 1 unhealthy or unreachable, 2 usage error. One line on stderr says why.

With --tls-cert/--tls-key/--tls-ca (default: the TANDEM_TLS_* variables, so a probe run inside a
service's container presents that service's certificate) the probe speaks TLS: mTLS to gRPC, and
HTTPS verified against the CA for an https:// URL.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.runtime.tls import TlsIdentity

DEFAULT_TIMEOUT_S = 3.0


def check_grpc(address: str, service: str = "", timeout: float = DEFAULT_TIMEOUT_S,
               tls: TlsIdentity | None = None, role: str | None = None) -> tuple[bool, str]:
    """(healthy, reason) from a grpc.health.v1 Check against `address` ("host:port").

    With `tls`, over mTLS; `role` then names the service expected (its certificate's
    tandem-<role> SAN is checked), else the address itself must be in the certificate."""
    import grpc  # imported here: the http probe must not pay for grpc's import
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.runtime.tls import Dialer

    try:
        with Dialer(tls).channel(address, role) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as exc:
        return False, f"grpc {address}: {exc.code().name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {address}: {status}"


def check_http(url: str, timeout: float = DEFAULT_TIMEOUT_S, tls: TlsIdentity | None = None) -> tuple[bool, str]:
    """(healthy, reason) from GET `url`: healthy only on status 200 (https: verified with `tls`)."""
    context = tls.client_ssl_context() if tls is not None and url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:  # noqa: S310 (probe URL is ours)
            return reply.status == 200, f"http {url}: {reply.status}"
    except urllib.error.HTTPError as exc:
        return False, f"http {url}: {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        return False, f"http {url}: {getattr(exc, 'reason', exc)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.runtime.health_probe",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    grpc_parser = sub.add_parser("grpc", help="grpc.health.v1 Check; healthy when SERVING")
    grpc_parser.add_argument("address", help="HOST:PORT")
    grpc_parser.add_argument("--service", default="", help="service name ('' = whole server)")
    http_parser = sub.add_parser("http", help="HTTP GET; healthy on 200")
    http_parser.add_argument("url")
    for p in (grpc_parser, http_parser):
        p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds")
        for name in ("cert", "key", "ca"):
            env = f"TANDEM_TLS_{name.upper()}"
            p.add_argument(f"--tls-{name}", default=os.environ.get(env) or None, help=f"TLS {name} (default ${env})")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_cert or args.tls_key or args.tls_ca:
        from services.runtime.tls import TlsError, TlsIdentity

        try:
            tls = TlsIdentity.load(args.tls_cert or "", args.tls_key or "", args.tls_ca or "")
        except TlsError as exc:
            print(f"unhealthy: {exc}", file=sys.stderr)
            return 2

    if args.kind == "grpc":
        healthy, reason = check_grpc(args.address, args.service, args.timeout, tls)
    else:
        healthy, reason = check_http(args.url, args.timeout, tls)
    print(("healthy: " if healthy else "unhealthy: ") + reason, file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    raise SystemExit(main())
