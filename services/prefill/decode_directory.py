"""Which decode addresses this prefill worker may dial: those registered as decode workers.

A Prefill header names the decode worker to push KV to; without this check anyone who can reach
the prefill port could make it open connections to any address (issue 11, defect 5).

    allowed(address) -> in the last registry listing (taken < ttl ago): yes, no Redis call
                     -> otherwise list the registry's decode workers again (one call shared by
                        concurrent misses) and look again
    Redis down       -> the last successful listing still counts: known workers keep working

Standalone (no --redis-url) there is no registry to consult, and every address is allowed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from services.runtime.registry import Registry, RegistryError, Role

logger = logging.getLogger(__name__)

LISTING_TTL_S = 5.0


@dataclass
class DecodeDirectory:
    registry: Registry | None
    ttl_s: float = LISTING_TTL_S
    _addresses: frozenset[str] = frozenset()
    _listed_at: float | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def cluster(self) -> str:
        return self.registry.cluster if self.registry is not None else ""

    async def allowed(self, address: str) -> bool:
        if self.registry is None:
            return True
        fresh = self._listed_at is not None and time.monotonic() - self._listed_at < self.ttl_s
        if address in self._addresses and fresh:
            return True
        listed_at = self._listed_at
        async with self._lock:
            if self._listed_at == listed_at:  # nobody refreshed while this call waited
                await self._refresh()
        return address in self._addresses

    async def _refresh(self) -> None:
        try:
            workers = await asyncio.to_thread(self.registry.list_workers, Role.DECODE)
        except RegistryError as e:  # keep the last listing: a Redis outage must not stop serving
            logger.warning("decode directory: registry unreachable (%s); using the last listing", e)
            return
        self._addresses = frozenset(w.address for w in workers)
        self._listed_at = time.monotonic()
