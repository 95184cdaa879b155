"""A gRPC aio server with what every Tandem server carries: grpc.health.v1 and reflection.

`credentials` (services/runtime/tls.py) make its port TLS/mTLS, else it is plaintext;
`interceptors` run before every servicer (the gateway's API-key check).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

# Far below gRPC's 4 MiB default on purpose: KV pieces are <= 1 MiB (see kv_transfer.proto).
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


def keepalive_options(interval_s: float, timeout_s: float) -> list[tuple[str, int]]:
    """Server keepalive: ping each connection that has calls open every interval_s; a peer that
    does not answer within timeout_s is gone (its calls are cancelled, so their handlers free what
    they held). gRPC's own default pings every 2 hours. interval_s 0: off."""
    if interval_s <= 0:
        return []
    timeout_ms = max(1, int(timeout_s * 1000))
    return [("grpc.keepalive_time_ms", max(1, int(interval_s * 1000))),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),  # what grpc-core 1.85 waits for the ack (60 s if unset)
            ("grpc.http2.max_pings_without_data", 0)]  # a quiet stream is pinged too  # fmt: skip


class GrpcServer:
    def __init__(self, service_names: Sequence[str], *, credentials: grpc.ServerCredentials | None = None,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 keepalive: tuple[float, float] | None = None) -> None:
        """keepalive: (interval_s, timeout_s) of keepalive_options; None: gRPC's defaults."""
        options = SERVER_OPTIONS + (keepalive_options(*keepalive) if keepalive else [])
        self.server = grpc.aio.server(options=options, interceptors=list(interceptors) or None)
        self.credentials = credentials
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.port = 0

    def add(self, register: Callable[[object, grpc.aio.Server], None], servicer: object) -> None:
        """add(decode_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(...))"""
        register(servicer, self.server)

    async def start(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        if self.credentials is None:
            self.port = self.server.add_insecure_port(address)
        else:
            self.port = self.server.add_secure_port(address, self.credentials)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        await self.server.start()
        await self.set_serving(True)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """Drain: health goes NOT_SERVING first, in-flight RPCs get `grace` seconds."""
        await self.set_serving(False)
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()
