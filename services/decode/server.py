"""Assembles a decode worker: engine loop, Decode + KVTransfer on one gRPC server, leases,
metrics, registry heartbeat, and drain.

    handle = await serve(settings)        # in-process (tests, `tandem up`), or via main()
    ...                                   # handle.address is what other services dial
    await handle.drain()                  # NOT_SERVING, deregister, let in-flight finish (--drain-timeout), stop
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from common.engine.llm_engine import LLMEngine
from common.sampling.text_tokens import TextTokens, load_text_tokens_async
from services.decode.kv_servicer import KVTransferServicer
from services.decode.leases import LeaseManager
from services.decode.remote_kv import RemoteKVTable
from services.decode.runner import RequestRunner
from services.decode.servicer import DecodeServicer, WorkerState, load_snapshot
from services.decode.speculation import SpecMetrics, build_decode_engine, close_proposer, spec_extra
from services.runtime import heap
from services.runtime.engine_factory import kv_layout
from services.runtime.engine_loop import EngineLoop
from services.runtime.grpc_server import GrpcServer
from services.runtime.liveness import EngineLiveness
from services.runtime.local_stream import LocalStreamServer, StreamMethod
from services.runtime.metrics import ServiceMetrics
from services.runtime.registry import (EXTRA_MAX_NUM_SEQS, AsyncHeartbeater, Registry, Role, WorkerInfo, WorkerLoad,
                                       local_socket_extra)
from services.runtime.routing import RecentPrefixes
from services.runtime.settings import DecodeSettings
from services.runtime.tls import TlsIdentity, server_credentials
from tandem.v1 import decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)

TANDEM_VERSION = "0.1.0"
DRAIN_UNCLAIMED_LEASE_S = 2.0
"""On drain, a reservation no Generate claimed and no piece reached gets at most this long."""


@dataclass
class DecodeHandle:
    """A running decode worker."""

    settings: DecodeSettings
    loop: EngineLoop
    server: GrpcServer
    table: RemoteKVTable
    state: WorkerState
    metrics: ServiceMetrics
    leases: LeaseManager
    heartbeater: AsyncHeartbeater | None
    registry: Registry | None
    address: str
    """host:port of the Decode and KVTransfer services (registered in Redis)."""
    worker_id: str
    liveness: EngineLiveness
    local: LocalStreamServer | None = None
    """Generate on a Unix socket (--local-socket), beside the gRPC port."""
    _stopped: bool = False

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def engine(self) -> LLMEngine:
        return self.loop.engine

    async def load(self) -> decode_pb2.DecodeLoad:
        return await load_snapshot(self.loop, self.table, self.state.draining)

    async def drain(self, grace_s: float | None = None) -> None:
        """Readiness fails, the worker leaves the registry and new work is refused at once;
        in-flight requests get grace_s (default --drain-timeout) to finish."""
        if self.state.draining:
            return await self.stop()
        grace_s = self.settings.common.drain_timeout if grace_s is None else grace_s
        self.state.draining = True
        await self.server.set_serving(False)
        if self.heartbeater is not None:  # routers stop picking it now, not at the record's TTL
            await self.heartbeater.stop(deregister=True)
        # Reservations whose owner is gone must not hold the exit for their whole lease.
        self.table.shorten_unclaimed_leases(min(DRAIN_UNCLAIMED_LEASE_S, grace_s))
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            busy = await self.loop.call(lambda e: e.has_unfinished_requests())
            if not busy and not self.table.pending:
                break
            await self.table.free_orphans()
            await asyncio.sleep(0.05)
        else:
            logger.warning("drain: grace period of %.1f s over; aborting what is left", grace_s)
        await self.stop()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.state.draining = True
        await self.liveness.stop()
        await self.leases.stop()
        if self.heartbeater is not None:
            await self.heartbeater.stop(deregister=True)
        if self.registry is not None:
            self.registry.close()
        if self.local is not None:
            await self.local.stop()
        await self.server.stop(grace=1.0)
        await asyncio.to_thread(self.loop.stop)
        await asyncio.to_thread(close_proposer, self.engine)
        logger.info("decode worker %s stopped", self.worker_id)


async def serve(settings: DecodeSettings, *, engine: LLMEngine | None = None,
                metrics: ServiceMetrics | None = None) -> DecodeHandle:  # fmt: skip
    """Starts a decode worker on the running event loop and returns once it serves.

    `engine` lets a caller pass a prebuilt engine (tests); by default it is built from settings.
    `settings.common.grpc_port` is bound as given.
    """
    common = settings.common
    engine = engine or build_decode_engine(settings)
    metrics = metrics or ServiceMetrics("decode")
    loop = EngineLoop(engine, name="decode-engine", stream_interval_s=settings.stream_interval_ms / 1e3)
    loop.step_listeners.append(metrics.observe_engine)
    loop.step_listeners.append(SpecMetrics(metrics).observe)
    if loop.stream_interval_s > 0:  # only a streamer that batches tokens needs to know which show text
        def text_tokens_ready(tokens: TextTokens) -> None:
            loop.text_tokens = tokens
            heap.freeze_again()  # loading the tokenizer imported much of transformers (heap.py)

        load_text_tokens_async(engine.vocab_tokenizer, text_tokens_ready)
    loop.start()

    layout = kv_layout(engine, common.served_model_name)
    table = RemoteKVTable(loop, layout, settings.kv_lease_seconds, metrics, vocab_size=engine.model_config.vocab_size)
    server = GrpcServer([decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name,
                         kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name],
                        credentials=server_credentials(TlsIdentity.from_settings(common)),
                        keepalive=common.keepalive)  # fmt: skip
    state = WorkerState(kv_transfer_address="", layout=layout, recent_prefixes=RecentPrefixes())
    if hasattr(engine.proposer, "trace_links"):  # a draft worker's Propose spans link to the requests
        engine.proposer.trace_links = state.trace_links
    runner = RequestRunner(loop, table, on_local_prefill=metrics.prefill_tokens.inc)
    servicer = DecodeServicer(loop, table, runner, state)
    server.add(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)
    server.add(kv_transfer_pb2_grpc.add_KVTransferServicer_to_server, KVTransferServicer(table))
    try:
        port = await server.start(common.host, common.grpc_port)
    except BaseException:
        await asyncio.to_thread(loop.stop)
        raise
    address = state.kv_transfer_address = f"{common.advertise_host}:{port}"
    local = await _serve_local_socket(settings.local_socket, servicer)
    leases = LeaseManager(table).start()
    liveness = EngineLiveness(loop, server, settings.engine.engine_stall_timeout, lambda: state.draining).start()
    if common.metrics_port is not None:
        metrics.serve(common.host, common.metrics_port)

    worker_id = f"decode-{address}"
    registry = heartbeater = None
    if common.redis_url:
        registry = Registry(common.redis_url, common.cluster)
        info = WorkerInfo(worker_id=worker_id, role=Role.DECODE, address=address,
                          model=common.served_model_name, version=TANDEM_VERSION)  # fmt: skip

        async def worker_load() -> WorkerLoad:
            load = await load_snapshot(loop, table, state.draining)
            return WorkerLoad(
                kv_blocks_free=load.num_free_blocks, kv_blocks_total=load.num_total_blocks,
                num_running=load.num_running, num_waiting=load.num_waiting + load.num_waiting_for_kv,
                extra={**state.recent_prefixes.to_extra(), "draining": state.draining, **spec_extra(engine),
                       EXTRA_MAX_NUM_SEQS: engine.config.scheduler.max_num_seqs,
                       **(local_socket_extra(local.path) if local is not None else {})},
            )  # fmt: skip

        heartbeater = AsyncHeartbeater(registry, info, worker_load, interval_s=common.heartbeat_interval,
                                       alive=liveness.check).start()
        logger.info("decode %s registering in cluster %r", worker_id, common.cluster)
    else:
        logger.warning("decode %s: no --redis-url, running standalone (not registered for routing)", worker_id)
    logger.info("decode worker serving %s on %s (%d KV blocks of %d tokens, steps of <= %d tokens, lease %.1f s)",
                common.served_model_name, address, engine.kv.num_blocks, layout.block_size,
                engine.config.scheduler.max_num_batched_tokens, settings.kv_lease_seconds)  # fmt: skip
    return DecodeHandle(settings, loop, server, table, state, metrics, leases, heartbeater, registry, address,
                        worker_id, liveness, local)


async def _serve_local_socket(path: str | None, servicer: DecodeServicer) -> LocalStreamServer | None:
    """Generate on a Unix socket too, or None (none asked for, or it could not be bound: the gRPC
    port serves every call then, so that is a warning, not a failure)."""
    if not path:
        return None
    try:
        local = await LocalStreamServer(path, {"Generate": StreamMethod(servicer.Generate, decode_pb2.DecodeRequest)}).start()
    except OSError as e:
        logger.warning("--local-socket %s: not served (%s); gateways reach this worker over gRPC", path, e)
        return None
    logger.info("decode Generate also on unix:%s", path)
    return local
