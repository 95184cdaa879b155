"""Where each request runs, kept in Redis with a TTL (`{cluster}:route:{request_id}`).

Written when the gateway routes a request and deleted when it ends, so any gateway replica can
abort a request it does not hold itself, and operators can see where a request went. Best
effort: with Redis down the request still runs; only the record is missing. A write that fails
(a Redis timeout on a loaded machine) is tried again a few times, and a request's delete waits
for its pending write, so a late write cannot bring back the record of a request that ended.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from services.runtime.registry import Registry, RegistryError

logger = logging.getLogger(__name__)
RECORD_RETRY_DELAYS_S = (0.25, 0.5, 1.0, 2.0)  # after the first try: ~4 s in all


class RouteRecords:
    def __init__(self, registry: Registry | None, ttl_s: float) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self._tasks: set[asyncio.Task] = set()
        self._writes: dict[str, asyncio.Task] = {}  # request id -> its record write in flight

    def record(self, request_id: str, internal_id: str, decode: str, prefill: str | None, owner: str = "",
               legs: Sequence[str] = ()) -> None:
        """owner: the caller's opaque id; only the same caller may abort through the record.
        legs: decode's request ids when there are several (a migrated n > 1 request)."""
        if self.registry is not None:
            route = {"internal_id": internal_id, "decode": decode, "prefill": prefill or "", "owner": owner}
            if len(legs) > 1:
                route["legs"] = list(legs)
            previous = self._writes.get(request_id)  # a migrated request's earlier route
            self._writes[request_id] = self._background(self._write, request_id, route, previous)

    def forget(self, request_id: str) -> None:
        if self.registry is not None:
            self._background(self._delete, request_id, self._writes.pop(request_id, None))

    async def _write(self, request_id: str, route: dict[str, Any], previous: asyncio.Task | None) -> None:
        if previous is not None:
            await asyncio.wait({previous})
        for delay in (*RECORD_RETRY_DELAYS_S, None):
            try:
                await asyncio.to_thread(self.registry.record_route, request_id, route, self.ttl_s)
                return
            except RegistryError as e:
                if delay is None:  # Redis down: the request itself is unaffected
                    logger.debug("route record of %s not written: %s", request_id, e)
                    return
            await asyncio.sleep(delay)

    async def _delete(self, request_id: str, write: asyncio.Task | None) -> None:
        if write is not None:
            await asyncio.wait({write})
        try:
            await asyncio.to_thread(self.registry.delete_route, request_id)
        except RegistryError as e:
            logger.debug("route record of %s not deleted: %s", request_id, e)

    async def lookup(self, request_id: str) -> dict[str, Any] | None:
        if self.registry is None:
            return None
        try:
            return await asyncio.to_thread(self.registry.get_route, request_id)
        except RegistryError as e:
            logger.info("route of %s unknown: %s", request_id, e)
            return None

    def _background(self, fn, *args: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
