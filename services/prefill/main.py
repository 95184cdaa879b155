"""`tandem prefill`: a prefill worker (Prefill gRPC service + health + reflection, metrics, registry).

In-process (tests, the launcher):

    handle = await serve(settings, grpc_port=0)      # 0: any free port; handle.address
    ...
    await handle.stop()                              # drain, deregister, stop the engine
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from common.engine.llm_engine import LLMEngine
from services.prefill.decode_directory import DecodeDirectory
from services.prefill.decode_peers import DecodePeers
from services.prefill.inflight import InflightTable, SpanRouter
from services.prefill.prefill_runner import PrefillRunner
from services.prefill.servicer import PrefillServicer
from services.runtime.engine_factory import build_engine, kv_layout
from services.runtime.engine_loop import EngineLoop
from services.runtime.grpc_server import GrpcServer
from services.runtime.liveness import EngineLiveness
from services.runtime.metrics import ServiceMetrics
from services.runtime.registry import AsyncHeartbeater, Registry, Role, WorkerInfo, WorkerLoad
from services.runtime.service_main import run_service
from services.runtime.settings import PrefillSettings
from services.runtime.tls import Dialer, TlsIdentity, server_credentials
from tandem.v1 import prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


@dataclass
class PrefillHandle:
    settings: PrefillSettings
    engine_loop: EngineLoop
    server: GrpcServer
    servicer: PrefillServicer
    table: InflightTable
    peers: DecodePeers
    metrics: ServiceMetrics
    address: str
    heartbeater: AsyncHeartbeater | None = None
    registry: Registry | None = None
    liveness: EngineLiveness | None = None

    @property
    def engine(self) -> LLMEngine:
        return self.engine_loop.engine

    @property
    def port(self) -> int:
        return self.server.port

    def load(self) -> WorkerLoad:
        load, kv = self.table.load(), self.engine.kv
        return WorkerLoad(
            kv_blocks_free=kv.num_free_blocks, kv_blocks_total=kv.num_blocks, num_running=load.num_running,
            num_waiting=self.engine.scheduler.num_waiting, queued_tokens=load.num_queued_tokens,
        )  # fmt: skip

    async def stop(self, grace: float | None = None) -> None:
        """Drain: NOT_SERVING, leave the registry, refuse new requests; in-flight ones (their KV
        still being pushed to decode, bounded by its lease) finish within grace (default
        --drain-timeout)."""
        self.servicer.draining = True
        await self.server.set_serving(False)
        if self.heartbeater is not None:
            await self.heartbeater.stop(deregister=True)
        grace = self.settings.common.drain_timeout if grace is None else grace
        deadline = time.monotonic() + grace
        while len(self.table) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.liveness is not None:
            await self.liveness.stop()
        await self.server.stop(grace=1.0)
        await self.peers.close()
        self.engine_loop.stop()
        if self.registry is not None:
            self.registry.close()


async def serve(settings: PrefillSettings, *, grpc_port: int | None = None, engine: LLMEngine | None = None) -> PrefillHandle:
    """Starts a prefill worker on the running event loop.

    grpc_port overrides settings.common.grpc_port (0 = a free port); engine: a prebuilt engine
    (tests), otherwise one is built from the settings."""
    common = settings.common
    engine = engine or build_engine(common, settings.engine)
    metrics = ServiceMetrics("prefill")
    table = InflightTable()
    layout = kv_layout(engine, common.served_model_name)
    engine.on_computed = SpanRouter(table, engine.kv_cache, metrics)
    engine_loop = EngineLoop(engine, name="prefill-engine")
    engine_loop.step_listeners.append(metrics.observe_engine)
    engine_loop.start()

    identity = TlsIdentity.from_settings(common)
    peers = DecodePeers(layout, sender_id="prefill", dialer=Dialer(identity))
    runner = PrefillRunner(engine_loop, peers, layout, metrics)
    servicer = PrefillServicer(runner, table, engine_loop, engine.kv.block_size)
    server = GrpcServer([SERVICE_NAME], credentials=server_credentials(identity))
    server.add(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)  # before start: grpc requires it
    port = await server.start(common.host, common.grpc_port if grpc_port is None else grpc_port)
    address = f"{common.advertise_host}:{port}"
    peers.sender_id = f"prefill@{address}"
    if common.metrics_port is not None:
        metrics.serve(common.host, common.metrics_port)
    handle = PrefillHandle(settings, engine_loop, server, servicer, table, peers, metrics, address)
    handle.liveness = EngineLiveness(engine_loop, server, settings.engine.engine_stall_timeout,
                                     lambda: servicer.draining).start()  # fmt: skip

    if common.redis_url:
        handle.registry = Registry(common.redis_url, common.cluster)
        runner.directory = DecodeDirectory(handle.registry)  # KV goes only to registered decode workers
        info = WorkerInfo(
            worker_id=f"prefill-{socket.gethostname()}-{port}", role=Role.PREFILL, address=address,
            model=common.served_model_name or common.model,
        )  # fmt: skip
        handle.heartbeater = AsyncHeartbeater(handle.registry, info, handle.load, interval_s=common.heartbeat_interval,
                                              alive=handle.liveness.check)
        handle.heartbeater.start()
    logger.info("prefill worker serving %s on %s (KV layout %s)", common.served_model_name, address, layout)
    return handle


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("prefill", argv, serve, lambda handle: handle.stop())


if __name__ == "__main__":
    raise SystemExit(main())
