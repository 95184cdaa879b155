"""The DraftWorker on one thread of its own: asyncio handlers `await loop.call(fn)`, like EngineLoop.

The worker is not thread-safe; every touch happens on this thread, one call at a time, so a
Propose, a Release and the lease sweep never interleave. The sweep runs every `sweep_s`.

Idle time goes to lookahead (DraftWorker.extend_lookahead): when no call is waiting, the thread
runs one batched draft step at a time past the last proposals, so a Propose that arrives waits
for at most one draft step before it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from common.spec_decode.draft_worker import DraftWorker

T = TypeVar("T")
logger = logging.getLogger(__name__)


class DraftLoop:
    def __init__(self, worker: DraftWorker, listeners: list[Callable[[DraftWorker], None]] | None = None,
                 lookahead: bool = False) -> None:  # fmt: skip
        self.worker = worker
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-worker")
        self.listeners = listeners or []
        """Called on the worker thread after every call (metrics)."""
        self._sweeper: asyncio.Task | None = None
        self.lookahead = lookahead
        self._lock = threading.Lock()
        self._waiting = 0  # calls submitted and not yet started
        self._lookahead_queued = False
        self._stopping = False
        self.lookahead_steps = 0
        """Draft steps run ahead so far (tests and metrics read it)."""
        self._busy_since: float | None = None  # time.monotonic() when the running call began

    def unresponsive_for(self) -> float:
        """Seconds the call now running on the worker thread has taken (0 when idle): what
        services/runtime/liveness.py reads, as for EngineLoop."""
        since = self._busy_since
        return max(0.0, time.monotonic() - since) if since is not None else 0.0

    async def call(self, fn: Callable[[DraftWorker], T]) -> T:
        def run() -> T:
            with self._lock:
                self._waiting -= 1
            self._busy_since = time.monotonic()
            try:
                return fn(self.worker)
            finally:
                self._busy_since = None
                for listener in self.listeners:
                    listener(self.worker)
                self._maybe_look_ahead()

        with self._lock:
            self._waiting += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def _maybe_look_ahead(self) -> None:
        """Queues one lookahead step behind the current work, unless a call is waiting or one is queued."""
        with self._lock:
            if not self.lookahead or self._stopping or self._waiting or self._lookahead_queued:
                return
            self._lookahead_queued = True
        self._pool.submit(self._look_ahead)

    def _look_ahead(self) -> None:
        with self._lock:
            self._lookahead_queued = False
            if self._waiting or self._stopping:
                return  # a call came in: it goes first, lookahead resumes after it
        try:
            extended = self.worker.extend_lookahead()
        except Exception:  # lookahead is an optimisation: never let it take the worker down
            logger.exception("draft lookahead step failed; lookahead stays off")
            self.lookahead = False
            return
        if extended:
            self.lookahead_steps += 1
            self._maybe_look_ahead()

    def start_sweeper(self, sweep_s: float) -> None:
        async def sweep() -> None:
            while True:
                await asyncio.sleep(sweep_s)
                await self.call(lambda w: w.expire_idle())

        self._sweeper = asyncio.get_running_loop().create_task(sweep())

    async def stop(self) -> None:
        with self._lock:
            self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        await asyncio.to_thread(self._pool.shutdown, wait=True)
