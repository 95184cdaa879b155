"""`tandem gateway`: the OpenAI REST API and the public gRPC Generation service, in one process.

Both servers run on one asyncio event loop, next to the registry view's refresher (a thread) and
the decode-worker health prober. With --standby-fd (a warm standby of `tandem up`), everything but
the two public ports is set up first, and the ports are bound only when the launcher says SERVE
(services/runtime/standby_link.py). In-process use (tests, the launcher):

    handle = await serve(settings, http_port=0, grpc_port=0)   # 0 = any free port
    ... handle.http_port, handle.grpc_port ...
    await handle.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import uvicorn

from services.gateway.admission import AdmissionQueue
from services.gateway.grpc_service import GenerationServicer, add_generation_servicer
from services.gateway.limits import KVCapacity, RequestLimits
from services.gateway.model import ServedModel
from services.gateway.orchestrator import DEFAULT_BLOCK_SIZE, Orchestrator
from services.gateway.rest_app import build_app
from services.gateway.workers import WorkerChannels, WorkerHealth
from services.runtime.auth import ApiKeyInterceptor, ApiKeyMiddleware, ApiKeys, rest_open_paths
from services.runtime.grpc_server import GrpcServer
from services.runtime.listen_socket import adopt_listener, bind_listener
from services.runtime.metrics import ServiceMetrics
from services.runtime.registry import CachedRegistryView, Registry
from services.runtime.service_main import run_service
from services.runtime.settings import GatewaySettings
from services.runtime.standby_link import await_promotion
from services.runtime.tls import Dialer, TlsIdentity, server_credentials
from tandem.v1 import generation_pb2

logger = logging.getLogger(__name__)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class Gateway:
    """The gateway's long-lived parts, shared by the REST app and the gRPC servicer."""

    def __init__(self, settings: GatewaySettings, model: ServedModel | None = None) -> None:
        common = settings.common
        self.settings = settings
        self.model = model or ServedModel.load(common.model, common.served_model_name)
        self.model.tool_call_parser = settings.tool_call_parser
        self.metrics = ServiceMetrics("gateway")
        self.registry = Registry(common.redis_url or DEFAULT_REDIS_URL, common.cluster)
        self.view = CachedRegistryView(self.registry, refresh_interval_s=min(1.0, common.heartbeat_interval))
        self.tls = TlsIdentity.from_settings(common)
        self.api_keys = ApiKeys.from_settings(settings)
        self.channels = WorkerChannels(Dialer(self.tls))
        # A decode worker counts as reachable for a few heartbeat intervals after it last answered.
        self.health = WorkerHealth(self.channels, fresh_s=max(3.0, 3 * common.heartbeat_interval))
        self.admission = AdmissionQueue(settings.max_queued_requests, on_change=self.metrics.waiting.set)
        self.limits = RequestLimits(max_request_body_bytes=settings.max_request_body_bytes, max_n=settings.max_n)
        self.orchestrator = Orchestrator(settings, self.model, self.view, self.channels, self.health,
                                         self.metrics, self.admission)
        self._prober: asyncio.Task | None = None
        self.draining = False  # SIGTERM: /health 503 while in-flight requests finish

    def kv_capacity(self) -> KVCapacity | None:
        """The roomiest decode worker's whole KV cache, from the registry (block sizes from GetLoad)."""
        return KVCapacity.of((w.kv_blocks_total, self.health.block_size.get(w.address, DEFAULT_BLOCK_SIZE))
                             for w in self.orchestrator.decode_workers())

    def health_status(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining: finishing in-flight requests before exit"
        workers = self.orchestrator.decode_workers()
        if not workers:
            snap = self.view.snapshot()
            return False, "no decode worker registered" + (f" (registry: {snap.error})" if snap.error else "")
        if not self.health.any_fresh(w.address for w in workers):
            return False, f"none of {len(workers)} registered decode worker(s) answered lately"
        return True, f"{len(workers)} decode worker(s)"

    async def _probe_forever(self) -> None:
        interval = self.settings.common.heartbeat_interval
        while True:
            addresses = [w.address for w in self.orchestrator.decode_workers()]
            with contextlib.suppress(Exception):
                await self.health.probe(addresses, timeout_s=max(0.5, interval))
            await asyncio.sleep(interval)

    async def warm_up(self, registry_wait_s: float = 30.0) -> None:
        """What a standby does before saying READY, so its first request pays no more than any:
        a registry read, a GetLoad to each decode worker, the tokenizer's first call."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + registry_wait_s
        while self.view.snapshot().fetched_at is None and loop.time() < deadline:
            await asyncio.sleep(0.05)
        interval = self.settings.common.heartbeat_interval
        await self.health.probe([w.address for w in self.orchestrator.decode_workers()], max(0.5, interval))
        self.model.tokenize("warm up")
        _ = self.model.max_token_chars  # a cached vocabulary scan that the length checks use

    def start_background(self) -> None:
        self.view.start()
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever(), name="decode-health")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        await self.orchestrator.close()
        await asyncio.to_thread(self.view.stop)
        await self.channels.close()
        self.registry.close()


@dataclass
class GatewayHandle:
    gateway: Gateway
    http_port: int
    grpc_port: int
    _grpc: GrpcServer
    _http: uvicorn.Server
    _http_task: asyncio.Task

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING / 503 and no new connections at once; in-flight requests get
        grace_s (default --drain-timeout) to finish."""
        grace_s = self.gateway.settings.common.drain_timeout if grace_s is None else grace_s
        self.gateway.draining = True
        self._http.config.timeout_graceful_shutdown = grace_s
        self._http.should_exit = True
        await self._grpc.stop(grace_s)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._http_task, grace_s + 3.0)
        await self.gateway.close()

    async def wait(self) -> None:
        await self._http_task


async def serve(settings: GatewaySettings, *, http_port: int | None = None, grpc_port: int | None = None,
                model: ServedModel | None = None) -> GatewayHandle:
    """Start the gateway on the running loop; ports default to the settings' (0 = any free port)."""
    gateway = Gateway(settings, model)
    host = settings.common.host
    gateway.start_background()
    if settings.standby_fd is not None and not await await_promotion(settings.standby_fd, gateway.warm_up()):
        await gateway.close()
        raise SystemExit(0)  # a standby that was never needed: nothing bound, nothing served
    # The public ports: TLS per --public-tls (mtls: client certificates too), API keys per --api-key.
    public_tls = gateway.tls if settings.public_tls != "off" else None
    require_client_cert = settings.public_tls == "mtls"
    grpc_server = GrpcServer([generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name],
                             credentials=server_credentials(public_tls, require_client_cert),
                             interceptors=[ApiKeyInterceptor(gateway.api_keys)] if gateway.api_keys.enabled else [],
                             keepalive=settings.common.keepalive)
    grpc_server.add(add_generation_servicer, GenerationServicer(gateway))
    bound_grpc = await grpc_server.start(host, settings.common.grpc_port if grpc_port is None else grpc_port)
    if settings.http_fd is not None:  # `tandem up` holds the port (services/runtime/listen_socket.py)
        sock = adopt_listener(settings.http_fd)
    else:
        sock = bind_listener(host, settings.http_port if http_port is None else http_port)
        sock.set_inheritable(True)
    app = build_app(gateway)
    if gateway.api_keys.enabled:
        app = ApiKeyMiddleware(app, gateway.api_keys, rest_open_paths(settings.metrics_auth))
    # httptools (a pinned dependency): the tiny model's TTFT at one stream 11.5 -> 9.5 ms against
    # uvicorn's pure-Python h11 parser, the same prompts sent to both in turn (2026-12-05).
    config = uvicorn.Config(app, log_level=settings.common.log_level, access_log=False, http="httptools",
                            lifespan="off", timeout_graceful_shutdown=2,
                            **(public_tls.uvicorn_config(require_client_cert) if public_tls else {}))
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # main() owns the signals
    http_task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="gateway-http")
    while not server.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        await grpc_server.stop(0)
        await gateway.close()
        http_task.result()
        raise OSError(f"the HTTP server did not start on {host}:{http_port}")
    logger.info("gateway for %r: %s %s:%d, gRPC %s:%d, mode %s, %s", gateway.model.name,
                "HTTPS" if public_tls else "HTTP", host, sock.getsockname()[1], host, bound_grpc, settings.mode,
                f"{len(gateway.api_keys.digests)} API key(s)" if gateway.api_keys.enabled else "no API keys")
    return GatewayHandle(gateway, sock.getsockname()[1], bound_grpc, grpc_server, server, http_task)


def main(argv: Sequence[str] | None = None) -> int:
    async def start(settings: GatewaySettings) -> GatewayHandle:
        handle = await serve(settings)
        scheme = "https" if settings.common.tls_enabled and settings.public_tls != "off" else "http"
        print(f"tandem gateway: {scheme}://{settings.common.host}:{handle.http_port} grpc {settings.common.host}:"
              f"{handle.grpc_port}", flush=True)  # fmt: skip
        return handle

    # Also stop when uvicorn's server ends on its own (it failed to bind, say).
    return run_service("gateway", argv, start, lambda handle: handle.stop(), watch=lambda handle: handle._http_task)


if __name__ == "__main__":
    raise SystemExit(main())
