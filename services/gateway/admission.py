"""The bounded admission queue: where requests wait when no decode worker has room.

    route -> Reserve on the best worker -> NO_CAPACITY -> next worker -> ... all full
      -> join the queue (full: Overloaded -> 429 / RESOURCE_EXHAUSTED)
      -> wait for a wake-up (a request of this gateway finished) or the poll interval
         (capacity freed elsewhere only shows up in the registry) -> route again

Only waiting requests count against --max-queued-requests; 0 means never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from services.gateway.errors import Overloaded


class AdmissionQueue:
    def __init__(self, max_waiting: int, poll_interval_s: float = 0.2) -> None:
        self.max_waiting = max_waiting
        self.poll_interval_s = poll_interval_s
        self.num_waiting = 0
        self._freed = asyncio.Event()

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a waiting slot for the duration; raises Overloaded when the queue is full."""
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(f"the gateway's admission queue is full ({self.max_waiting} waiting); "
                             "retry later", code="queue_full")
        self.num_waiting += 1
        try:
            yield
        finally:
            self.num_waiting -= 1

    async def wait_for_capacity(self) -> None:
        """Returns when capacity may have been freed (a wake-up or the poll interval)."""
        # asyncio.timeout, not wait_for: a cancelled waiter (its client left) must not be
        # swallowed by a wake-up arriving at the same moment (wait_for's race on 3.11).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.poll_interval_s):
                await self._freed.wait()

    def notify_freed(self) -> None:
        """A request finished somewhere we route to: wake every waiter to route again."""
        self._freed.set()
        self._freed = asyncio.Event()
