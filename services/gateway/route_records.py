"""Where each request runs, kept in Redis with a TTL (`{cluster}:route:{request_id}`).

Written when the gateway routes a request and deleted when it ends, so any gateway replica can
abort a request it does not hold itself, and operators can see where a request went. Best
effort: with Redis down the request still runs; only the record is missing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from services.runtime.registry import Registry, RegistryError

logger = logging.getLogger(__name__)


class RouteRecords:
    def __init__(self, registry: Registry | None, ttl_s: float) -> None:
        self.registry = registry
        self.ttl_s = ttl_s
        self._tasks: set[asyncio.Task] = set()

    def record(self, request_id: str, internal_id: str, decode: str, prefill: str | None, owner: str = "",
               legs: Sequence[str] = ()) -> None:
        """owner: the caller's opaque id; only the same caller may abort through the record.
        legs: decode's request ids when there are several (a migrated n > 1 request)."""
        if self.registry is not None:
            route = {"internal_id": internal_id, "decode": decode, "prefill": prefill or "", "owner": owner}
            if len(legs) > 1:
                route["legs"] = list(legs)
            self._background(self.registry.record_route, request_id, route, self.ttl_s)

    def forget(self, request_id: str) -> None:
        if self.registry is not None:
            self._background(self.registry.delete_route, request_id)

    async def lookup(self, request_id: str) -> dict[str, Any] | None:
        if self.registry is None:
            return None
        try:
            return await asyncio.to_thread(self.registry.get_route, request_id)
        except RegistryError as e:
            logger.info("route of %s unknown: %s", request_id, e)
            return None

    def _background(self, fn, *args: Any) -> None:
        async def run() -> None:
            try:
                await asyncio.to_thread(fn, *args)
            except RegistryError as e:  # Redis down: the request itself is unaffected
                logger.debug("route record %s failed: %s", args[0], e)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
