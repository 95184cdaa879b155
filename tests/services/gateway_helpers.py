"""Shared pieces of the gateway tests: a served model, settings, a running gateway."""

from __future__ import annotations

from pathlib import Path

from services.gateway.model import ServedModel
from services.runtime.settings import CommonSettings, GatewaySettings

MODEL_NAME = "tiny"


def gateway_settings(model: Path, redis_url: str, cluster: str, **kw) -> GatewaySettings:
    common = CommonSettings(model=str(model), served_model_name=MODEL_NAME, host="127.0.0.1",
                            redis_url=redis_url, cluster=cluster, heartbeat_interval=0.2, log_level="warning")
    return GatewaySettings(common=common, **kw)


_models: dict[str, ServedModel] = {}


def served_model(model: Path) -> ServedModel:
    if str(model) not in _models:
        _models[str(model)] = ServedModel.load(model, MODEL_NAME)
    return _models[str(model)]


# -- a small real cluster on one background event loop ---------------------------------------------

import asyncio  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any, TypeVar  # noqa: E402

import httpx  # noqa: E402

from services.runtime.settings import DecodeSettings, EngineSettings, PrefillSettings  # noqa: E402

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(num_kv_blocks: int, max_num_seqs: int = 16) -> EngineSettings:
    return EngineSettings(device="cpu", dtype="float32", block_size=16, num_kv_blocks=num_kv_blocks,
                          max_num_batched_tokens=64, max_num_seqs=max_num_seqs, torch_threads=1)


def _common(model: Path, redis_url: str, cluster: str, port: int, **extra: Any) -> CommonSettings:
    # Workers share one loop thread with the gateways: a slow request there (a fuzzer's megabyte
    # body) must not outlast the record's TTL (3 intervals), or the gateway sees no worker (503).
    return CommonSettings(model=str(model), served_model_name=MODEL_NAME, host="127.0.0.1", grpc_port=port,
                          redis_url=redis_url, cluster=cluster, heartbeat_interval=1.0, log_level="warning",
                          **extra)  # fmt: skip


class MiniCluster:
    """decode (+ prefill) + an aggregated and a disaggregated gateway, all on one loop thread.

    Tests talk HTTP/gRPC to it from their own thread; `run(fn)` executes a coroutine there."""

    def __init__(self, model: Path, redis_url: str, *, prefill: bool = True, num_kv_blocks: int = 96,
                 prefill_kv_blocks: int | None = None, max_num_seqs: int = 16, served: ServedModel | None = None,
                 worker_common: dict[str, Any] | None = None, decode_socket: str | None = None,
                 **gateway_kw: Any) -> None:
        """prefill_kv_blocks: the prefill worker's cache (default num_kv_blocks); max_num_seqs:
        decode's; served: the gateway's view of the model (default: the folder's); gateway_kw:
        more GatewaySettings for both gateways; worker_common: more CommonSettings for the workers;
        decode_socket: decode also serves Generate on this Unix socket (the gateways use it)."""
        self.model = model
        self.cluster = f"gwtest-{uuid.uuid4().hex[:8]}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-test-loop", daemon=True)
        self._thread.start()
        from services.decode.server import serve as serve_decode

        self.decode = self.run(lambda: serve_decode(DecodeSettings(
            common=_common(model, redis_url, self.cluster, free_port(), **(worker_common or {})),
            engine=_engine(num_kv_blocks, max_num_seqs), local_socket=decode_socket)))
        self.prefill = None
        if prefill:
            from services.prefill.main import serve as serve_prefill

            self.prefill = self.run(lambda: serve_prefill(PrefillSettings(
                common=_common(model, redis_url, self.cluster, 50061, **(worker_common or {})),
                engine=_engine(prefill_kv_blocks or num_kv_blocks)),
                grpc_port=0))
        from services.gateway.main import serve as serve_gateway

        self.gateways = {}
        for mode in ("aggregated", "disaggregated"):
            settings = gateway_settings(model, redis_url, self.cluster, mode=mode, prefill_chunk_size=16, **gateway_kw)
            self.gateways[mode] = self.run(lambda s=settings: serve_gateway(
                s, http_port=0, grpc_port=0, model=served or served_model(model)))
        self.wait_healthy()

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
        async def go() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout)

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.gateways[mode].http_port}"

    def wait_healthy(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        need_prefill = self.prefill is not None
        while time.monotonic() < deadline:
            ok = all(httpx.get(self.url(m) + "/health").status_code == 200 for m in self.gateways)
            gw = self.gateways["disaggregated"].gateway
            if ok and (not need_prefill or gw.view.workers("prefill")):
                return
            time.sleep(0.1)
        raise AssertionError("the gateways never saw a healthy decode worker")

    def decode_at_baseline(self, timeout: float = 5.0) -> bool:
        """No request left on decode, every block free (prefix-cache blocks count as free)."""
        def idle(engine: Any) -> bool:
            engine.check_integrity()
            return not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks

        deadline = time.monotonic() + timeout
        while True:
            ok = self.run(lambda: self.decode.loop.call(idle)) and not self.decode.table.pending
            if ok or time.monotonic() > deadline:
                return ok
            time.sleep(0.05)

    def close(self) -> None:
        for handle in self.gateways.values():
            self.run(handle.stop)
        if self.prefill is not None:
            self.run(self.prefill.stop)
        self.run(self.decode.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
