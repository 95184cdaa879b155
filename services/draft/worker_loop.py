"""The DraftWorker on one thread of its own: asyncio handlers `await loop.call(fn)`, like EngineLoop.

The worker is not thread-safe; every touch happens on this thread, one call at a time, so a
Propose, a Release and the lease sweep never interleave. The sweep runs every `sweep_s`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

from common.spec_decode.draft_worker import DraftWorker

T = TypeVar("T")


class DraftLoop:
    def __init__(self, worker: DraftWorker, listeners: list[Callable[[DraftWorker], None]] | None = None) -> None:
        self.worker = worker
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")
        self.listeners = listeners or []
        """Called on the worker thread after every call (metrics)."""
        self._sweeper: asyncio.Task | None = None

    async def call(self, fn: Callable[[DraftWorker], T]) -> T:
        def run() -> T:
            try:
                return fn(self.worker)
            finally:
                for listener in self.listeners:
                    listener(self.worker)

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def start_sweeper(self, sweep_s: float) -> None:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(sweep_s)
                await self.call(lambda w: w.expire_idle())

        self._sweeper = asyncio.get_running_loop().create_task(sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await asyncio.to_thread(self._pool.shutdown, wait=True)
