"""The gateway's route records against a real Redis server that goes away: a write that fails is
tried again (before, one failed write left the request without a record for its whole life, and
tests that find a stream's decode worker by its record waited in vain on a loaded machine), and
a request's delete waits for its pending write, so the record of an ended request stays gone."""

from __future__ import annotations

import asyncio

from services.gateway.route_records import RECORD_RETRY_DELAYS_S, RouteRecords
from services.runtime.registry import Registry

ROUTE = {"internal_id": "gw-1", "decode": "10.0.0.1:1", "prefill": "", "owner": ""}


async def _settle(records: RouteRecords) -> None:
    while records._tasks:
        await asyncio.wait(set(records._tasks))


def _record_through_an_outage(private_redis, request_id: str, *, forget: bool) -> tuple[dict | None, RouteRecords]:
    """record() (and forget() when asked) while Redis is down; Redis comes back after the first try."""
    with Registry(private_redis.url, "routes", socket_timeout_s=0.2, retries=0) as registry:
        records = RouteRecords(registry, ttl_s=60)

        async def go():
            private_redis.stop()
            records.record(request_id, "gw-1", "10.0.0.1:1", None)
            if forget:  # the request ends while its write is still being retried
                records.forget(request_id)
            await asyncio.sleep(RECORD_RETRY_DELAYS_S[0] / 2)  # the first try has failed by now
            private_redis.start()
            await _settle(records)
            return registry.get_route(request_id)

        return asyncio.run(go()), records


def test_a_write_during_an_outage_lands_when_redis_is_back(private_redis):
    assert _record_through_an_outage(private_redis, "r1", forget=False)[0] == ROUTE


def test_a_forget_waits_for_the_write_it_follows(private_redis):
    route, records = _record_through_an_outage(private_redis, "r2", forget=True)
    assert route is None and not records._writes


def test_a_migrated_request_keeps_its_latest_route(private_redis):
    with Registry(private_redis.url, "routes") as registry:
        records = RouteRecords(registry, ttl_s=60)

        async def go():
            records.record("r3", "gw-1", "10.0.0.1:1", None)
            records.record("r3", "gw-2", "10.0.0.2:1", None)  # routed again after a fault
            await _settle(records)
            return registry.get_route("r3")

        assert asyncio.run(go())["decode"] == "10.0.0.2:1"
