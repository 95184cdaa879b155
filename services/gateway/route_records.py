"""Where each request runs, kept in Redis with a TTL (`{cluster}:route:{request_id}`).

Written while a request runs and deleted when it ends, so any gateway replica can abort a request
it does not hold itself, and operators can see where a request went. Best effort: with Redis down
the request still runs; only the record is missing.

Records are written in batches, off the request's path: record() and forget() only note the change,
and one background flush every FLUSH_INTERVAL_S sends every change noted since (one pipeline, one
round trip, one hop to a thread). A request that ends before the next flush never touches Redis:
at one stream a small model's request used to pay a write and a delete (two thread hops and their
GIL time) inside its time to first token. So a record exists from at most FLUSH_INTERVAL_S after
the request was routed (an abort through another replica within that time finds no record, as
one could before whenever the write was still in flight). Flushes run one at a time, in order, so
a request's delete always follows its write. A flush that fails (a Redis timeout on a loaded
machine) is tried again after RECORD_RETRY_DELAYS_S, with whatever changed meanwhile merged in.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from services.runtime.registry import Registry, RegistryError

logger = logging.getLogger(__name__)
FLUSH_INTERVAL_S = 0.05
RECORD_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)  # after a failed flush: ~4 s in all, then its changes are dropped


class RouteRecords:
    def __init__(self, registry: Registry | None, ttl_s: float, flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self._writes: dict[str, dict[str, Any]] = {}  # request id -> its route, for the next flush
        self._deletes: set[str] = set()  # request ids whose record the next flush deletes
        self._stored: set[str] = set()  # request ids whose record was sent to Redis (and not deleted)
        self._flusher: asyncio.Task | None = None

    def record(self, request_id: str, internal_id: str, decode: str, prefill: str | None, owner: str = "",
               legs: Sequence[str] = ()) -> None:
        """owner: the caller's opaque id; only the same caller may abort through the record.
        legs: decode's request ids when there are several (a migrated n > 1 request). A second
        record of a request (migrated) replaces the first."""
        if self.registry is None:
            return
        route: dict[str, Any] = {"internal_id": internal_id, "decode": decode, "prefill": prefill or "", "owner": owner}
        if len(legs) > 1:
            route["legs"] = list(legs)
        self._writes[request_id] = route
        self._wake()

    def forget(self, request_id: str) -> None:
        if self.registry is None:
            return
        self._writes.pop(request_id, None)  # never sent: nothing to delete
        if request_id in self._stored:
            self._deletes.add(request_id)
            self._wake()

    @property
    def pending(self) -> int:
        """Changes noted and not yet flushed."""
        return len(self._writes) + len(self._deletes)

    async def settle(self) -> None:
        """Waits until every change noted so far was flushed (or given up on)."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.wait({self._flusher})

    async def lookup(self, request_id: str) -> dict[str, Any] | None:
        if self.registry is None:
            return None
        try:
            return await asyncio.to_thread(self.registry.get_route, request_id)
        except RegistryError as e:
            logger.info("route of %s unknown: %s", request_id, e)
            return None

    def _wake(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="route-records")

    async def _flush_loop(self) -> None:
        failures = 0
        while self._writes or self._deletes:
            await asyncio.sleep(self.flush_interval_s if failures == 0 else RECORD_RETRY_DELAYS_S[failures - 1])
            writes, self._writes = self._writes, {}
            deletes, self._deletes = self._deletes, set()
            if not writes and not deletes:
                continue
            self._stored |= writes.keys()
            try:
                await asyncio.to_thread(self.registry.apply_routes, writes, deletes, self.ttl_s)
            except RegistryError as e:
                failures += 1
                if failures > len(RECORD_RETRY_DELAYS_S):  # Redis down: the requests themselves are unaffected
                    logger.debug("%d route record changes not made: %s", len(writes) + len(deletes), e)
                    self._stored -= deletes  # their records expire with the TTL
                    failures = 0
                    continue
                for request_id, route in writes.items():  # again, unless replaced or forgotten meanwhile
                    if request_id not in self._writes and request_id not in self._deletes:
                        self._writes[request_id] = route
                self._deletes |= deletes
                continue
            failures = 0
            self._stored -= deletes
