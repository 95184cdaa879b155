"""Frees reservations whose KV did not arrive in time (--kv-lease-seconds).

A lease starts at Reserve and is renewed by every accepted KV piece; it ends when the request
is committed (KV complete and a Generate call attached). `RemoteKVTable.expire_due` does the
freeing and applies the failure policy; this only calls it on a timer, and sweeps engine
reservations that lost their owner (`RemoteKVTable.free_orphans`, a backstop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.decode.remote_kv import RemoteKVTable

logger = logging.getLogger(__name__)


class LeaseManager:
    def __init__(self, table: RemoteKVTable, tick_s: float | None = None) -> None:
        self.table = table
        # Check often enough that a lease overruns by at most ~10% (and never sleep over 1 s).
        self.tick_s = tick_s if tick_s is not None else min(1.0, max(0.01, table.default_lease_s / 10))
        self._task: asyncio.Task[None] | None = None

    def start(self) -> LeaseManager:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-leases")
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            for request_id in self.table.expire_due():
                logger.warning("reservation of %s expired: its KV did not arrive within the lease", request_id)
            try:
                await self.table.free_orphans()
            except Exception:  # noqa: BLE001 - a failed sweep must not stop the lease timer
                logger.exception("orphan reservation sweep failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
