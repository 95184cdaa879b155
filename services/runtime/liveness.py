"""Engine liveness as grpc.health.v1: a worker whose engine thread hangs reports NOT_SERVING.

    engine thread stamps EngineLoop.last_beat every turn (idle turns included); the draft
    worker's thread (DraftLoop) reports how long its running call has taken
    EngineLiveness (asyncio task): unresponsive_for() > timeout  -> NOT_SERVING (logged once)
                                   back under it (and not draining) -> SERVING again

The gRPC server itself stays up, so a hung worker is told apart from a dead one; the gateway's
stall check asks this health (services/gateway/orchestrator.py) and migrates the worker's
streams; its heartbeat stops too (AsyncHeartbeater's `alive` is `check`), so its registry record
expires and routers stop sending it work. A merely slow engine keeps both: its health answers
SERVING and its heartbeat goes on with the last load it read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Protocol

from services.runtime.grpc_server import GrpcServer

logger = logging.getLogger(__name__)


class WorkerThread(Protocol):
    """EngineLoop (prefill, decode) or DraftLoop (draft)."""

    def unresponsive_for(self) -> float: ...


class EngineLiveness:
    def __init__(self, loop: WorkerThread, server: GrpcServer, timeout_s: float,
                 draining: Callable[[], bool] = lambda: False) -> None:
        self.loop, self.server, self.timeout_s, self.draining = loop, server, timeout_s, draining
        self.live = True
        self._task: asyncio.Task | None = None

    def check(self) -> bool:
        """True while the engine thread keeps coming round within timeout_s."""
        return self.loop.unresponsive_for() <= self.timeout_s

    async def update(self) -> None:
        live = self.check()
        if live == self.live:
            return
        self.live = live
        if live:
            logger.warning("engine responsive again: health SERVING")
        else:
            logger.error("engine thread unresponsive for %.1f s (> %.1f s): health NOT_SERVING",
                         self.loop.unresponsive_for(), self.timeout_s)  # fmt: skip
        if not self.draining():
            await self.server.set_serving(live)

    def start(self) -> EngineLiveness:
        async def run() -> None:
            interval = min(1.0, self.timeout_s / 4)
            while True:
                await asyncio.sleep(interval)
                await self.update()

        self._task = asyncio.get_running_loop().create_task(run(), name="engine-liveness")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
