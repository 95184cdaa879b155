"""Assembles a draft worker: DraftWorker on its thread, the Draft gRPC service (+ health and
reflection), lease sweep, metrics, registry heartbeat (role=draft), and drain.

    handle = await serve(settings)        # in-process (tests, `tandem up`), or via main()
    ...                                   # handle.address is what decode dials
    await handle.drain(grace_s)           # NOT_SERVING, refuse Propose, deregister, stop
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from common.spec_decode.draft_worker import DraftWorker, DraftWorkerConfig
from services.draft.servicer import DraftServicer, load_of
from services.draft.worker_loop import DraftLoop
from services.runtime.grpc_server import GrpcServer
from services.runtime.liveness import EngineLiveness
from services.runtime.metrics import ServiceMetrics
from services.runtime.registry import AsyncHeartbeater, Registry, Role, WorkerInfo, WorkerLoad
from services.runtime.settings import DraftSettings
from services.runtime.tls import TlsIdentity, server_credentials
from tandem.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

TANDEM_VERSION = "0.1.0"
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["Draft"].full_name


@dataclass
class DraftHandle:
    settings: DraftSettings
    loop: DraftLoop
    server: GrpcServer
    servicer: DraftServicer
    metrics: ServiceMetrics
    heartbeater: AsyncHeartbeater | None
    registry: Registry | None
    address: str
    worker_id: str
    liveness: EngineLiveness | None = None
    _stopped: bool = False

    @property
    def worker(self) -> DraftWorker:
        return self.loop.worker

    async def drain(self, grace_s: float | None = None) -> None:
        """Readiness fails and Propose answers UNAVAILABLE at once (decode just stops speculating);
        in-flight calls get grace_s (default --drain-timeout)."""
        self.servicer.draining = True
        await self.server.set_serving(False)
        await self.stop(self.settings.common.drain_timeout if grace_s is None else grace_s)

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.servicer.draining = True
        if self.liveness is not None:
            await self.liveness.stop()
        if self.heartbeater is not None:
            await self.heartbeater.stop(deregister=True)
        if self.registry is not None:
            self.registry.close()
        await self.server.stop(grace=grace_s)
        await self.loop.stop()
        logger.info("draft worker %s stopped", self.worker_id)


def worker_config(settings: DraftSettings, lease_s: float, max_num_draft_tokens: int) -> DraftWorkerConfig:
    e = settings.engine
    return DraftWorkerConfig(
        model=settings.common.model, dtype=e.dtype, weight_dtype=e.weight_dtype, device=e.device, attention_backend=e.attention_backend,
        block_size=e.block_size, num_kv_blocks=e.num_kv_blocks, kv_cache_memory=e.kv_cache_memory,
        max_num_draft_tokens=max_num_draft_tokens, max_num_seqs=e.max_num_seqs, lease_s=lease_s,
    )  # fmt: skip


async def serve(settings: DraftSettings, *, lease_s: float | None = None,
                max_num_draft_tokens: int | None = None) -> DraftHandle:  # fmt: skip
    """Starts a draft worker on the running event loop; returns once it serves. lease_s and
    max_num_draft_tokens default to the settings' --lease-seconds / --max-num-draft-tokens."""
    common = settings.common
    lease_s = settings.lease_seconds if lease_s is None else lease_s
    max_num_draft_tokens = settings.max_num_draft_tokens if max_num_draft_tokens is None else max_num_draft_tokens
    if settings.engine.torch_threads:
        torch.set_num_threads(settings.engine.torch_threads)
    worker = await asyncio.to_thread(DraftWorker, worker_config(settings, lease_s, max_num_draft_tokens))
    metrics = ServiceMetrics("draft")

    def observe(w: DraftWorker) -> None:
        metrics.kv_total.set(w.kv.num_blocks)
        metrics.kv_used.set(w.kv.num_blocks - w.kv.num_free_blocks)
        metrics.kv_usage.set(w.kv.usage)
        metrics.running.set(w.num_sequences)

    loop = DraftLoop(worker, [observe], lookahead=settings.lookahead)
    loop.start_sweeper(min(lease_s / 4, 5.0))
    server = GrpcServer([SERVICE_NAME], credentials=server_credentials(TlsIdentity.from_settings(common)),
                        keepalive=common.keepalive)
    servicer = DraftServicer(loop, common.served_model_name)
    server.add(draft_pb2_grpc.add_DraftServicer_to_server, servicer)
    try:
        port = await server.start(common.host, common.grpc_port)
    except BaseException:
        await loop.stop()
        raise
    address = f"{common.advertise_host}:{port}"
    if common.metrics_port is not None:
        metrics.serve(common.host, common.metrics_port)
    liveness = EngineLiveness(loop, server, settings.engine.engine_stall_timeout, lambda: servicer.draining).start()
    worker_id = f"draft-{address}"
    registry = heartbeater = None
    if common.redis_url:
        registry = Registry(common.redis_url, common.cluster)
        info = WorkerInfo(worker_id=worker_id, role=Role.DRAFT, address=address, model=common.served_model_name,
                          version=TANDEM_VERSION, extra={"tokenizer_hash": worker.tokenizer_hash})  # fmt: skip

        async def worker_load() -> WorkerLoad:
            load = await loop.call(load_of)
            return WorkerLoad(kv_blocks_free=load.num_free_blocks, kv_blocks_total=load.num_total_blocks,
                              num_running=load.num_sequences, extra={"draining": servicer.draining})  # fmt: skip

        heartbeater = AsyncHeartbeater(registry, info, worker_load, interval_s=common.heartbeat_interval,
                                       alive=liveness.check).start()
    else:
        logger.warning("draft %s: no --redis-url, not registered (decode finds draft workers in the registry)", worker_id)
    logger.info("draft worker serving %s on %s (%d KV blocks, lease %.0f s)", common.served_model_name, address,
                worker.kv.num_blocks, lease_s)  # fmt: skip
    return DraftHandle(settings, loop, server, servicer, metrics, heartbeater, registry, address, worker_id, liveness)
