"""The bounded admission queue: where requests wait when no decode worker has room.

    arrive -> admit: sequences in flight (running or waiting, this gateway) + n
              > what the decode workers run at once (sum of their max_num_seqs) + --max-queued-requests
              -> Overloaded -> 429 / RESOURCE_EXHAUSTED, before anything is routed
    route -> Reserve on the best worker -> NO_CAPACITY -> next worker -> ... all full
      -> join the queue (full: Overloaded -> 429 / RESOURCE_EXHAUSTED)
      -> wait for a wake-up (a request of this gateway finished) or the poll interval
         (capacity freed elsewhere only shows up in the registry) -> route again

Every count is in sequences (n): a request with n = 8 takes 8 places. The admit check bounds what
queues anywhere, in this gateway's queue or in a decode worker's scheduler (LOCAL requests, n > 1
ones included, go straight to decode, which queues what it cannot run): running sequences count,
so the sequences beyond the workers' max_num_seqs are at most --max-queued-requests. The queue's
own places count waiting requests, and a request routed to a decode worker that has no room
(LOCAL: decode queues it itself), until its first token. 0 means never wait.
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
        self.num_in_flight = 0  # sequences of admitted requests, running or waiting, until they end
        self.on_change = on_change  # e.g. the waiting gauge's set
        self._freed = asyncio.Event()

    @contextlib.contextmanager
    def admit(self, sequences: int, run_capacity: int | None) -> Iterator[None]:
        """Holds a request's sequences in flight until it ends; raises Overloaded when they would
        queue past the cap. run_capacity: sequences the decode workers run at once (None: no
        worker known, so routing answers 503 instead)."""
        if run_capacity is not None and self.num_in_flight + sequences > run_capacity + self.max_waiting:
            raise Overloaded(f"the gateway is at capacity: {self.num_in_flight} sequences running or waiting, "
                             f"the decode workers run {run_capacity} at once and at most {self.max_waiting} may "
                             f"wait (--max-queued-requests); this request has {sequences}; retry later",
                             code="queue_full")
        self.num_in_flight += sequences
        try:
            yield
        finally:
            self.num_in_flight -= sequences

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
