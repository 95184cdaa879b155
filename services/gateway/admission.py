"""The bounded admission queue: where requests wait when no decode worker has room.

    route -> Reserve on the best worker -> NO_CAPACITY -> next worker -> ... all full
      -> join the queue (full: Overloaded -> 429 / RESOURCE_EXHAUSTED)
      -> wait for a wake-up (a request of this gateway finished) or the poll interval
         (capacity freed elsewhere only shows up in the registry) -> route again

Only waiting requests count against --max-queued-requests, each by its sequences (n): a request
with n = 8 takes 8 places. A request routed to a decode worker that has no room (LOCAL: decode
queues it itself) counts too, until its first token. 0 means never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

from services.gateway.errors import Overloaded


class AdmissionQueue:
    def __init__(self, max_waiting: int, poll_interval_s: float = 0.2,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.max_waiting = max_waiting
        self.poll_interval_s = poll_interval_s
        self.num_waiting = 0
        self.on_change = on_change  # e.g. the waiting gauge's set
        self._freed = asyncio.Event()

    @contextlib.contextmanager
    def slot(self, sequences: int = 1) -> Iterator[None]:
        """Hold `sequences` waiting places for the duration; raises Overloaded when they do not fit."""
        if self.num_waiting + sequences > self.max_waiting:
            raise Overloaded(f"the gateway's admission queue is full ({self.num_waiting} of {self.max_waiting} "
                             f"sequences waiting, this request has {sequences}); retry later", code="queue_full")
        self._add(sequences)
        try:
            yield
        finally:
            self._add(-sequences)

    def _add(self, sequences: int) -> None:
        self.num_waiting += sequences
        if self.on_change is not None:
            self.on_change(self.num_waiting)

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
