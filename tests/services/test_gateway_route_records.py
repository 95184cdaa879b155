"""The gateway's route records against a real Redis server (that goes away in some tests).

Records are flushed in batches: a request that ends before the next flush never touches Redis,
a record outlives a Redis outage (the flush is tried again), a request's delete follows its
write, and a migrated request keeps its latest route."""

from __future__ import annotations

import asyncio

import redis

from services.gateway.route_records import FLUSH_INTERVAL_S, RECORD_RETRY_DELAYS_S, RouteRecords
from services.runtime.registry import Registry

ROUTE = {"internal_id": "gw-1", "decode": "10.0.0.1:1", "prefill": "", "owner": ""}


def _route_commands(url: str) -> int:
    """SETs and DELs the Redis server has run so far."""
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("set", "del"))


def _through_an_outage(private_redis, request_id: str, *, forget: bool) -> tuple[dict | None, RouteRecords]:
    """record() while Redis is down; the first flush fails, then (forget) the request ends while its
    write waits to be tried again; Redis comes back; every change settled."""
    with Registry(private_redis.url, "routes", socket_timeout_s=0.2, retries=0) as registry:
        records = RouteRecords(registry, ttl_s=60)

        async def go():
            private_redis.stop()
            records.record(request_id, "gw-1", "10.0.0.1:1", None)
            await asyncio.sleep(FLUSH_INTERVAL_S + RECORD_RETRY_DELAYS_S[0] / 2)  # the first flush has failed by now
            if forget:
                records.forget(request_id)
            private_redis.start()
            await records.settle()

        asyncio.run(go())
        return registry.get_route(request_id), records


def test_a_write_during_an_outage_lands_when_redis_is_back(private_redis):
    route, records = _through_an_outage(private_redis, "r1", forget=False)
    assert route == ROUTE and records.pending == 0


def test_a_forget_after_a_failed_flush_leaves_no_record(private_redis):
    route, records = _through_an_outage(private_redis, "r2", forget=True)
    assert route is None and records.pending == 0 and not records._stored


def test_a_short_request_never_touches_redis(private_redis):
    with Registry(private_redis.url, "routes") as registry:
        records = RouteRecords(registry, ttl_s=60, flush_interval_s=10.0)
        before = _route_commands(private_redis.url)

        async def go():
            records.record("r3", "gw-1", "10.0.0.1:1", None)
            records.forget("r3")  # ended before the flush
            await records.settle()

        asyncio.run(go())
        assert _route_commands(private_redis.url) == before and registry.get_route("r3") is None


def test_records_are_written_together_and_deleted_after(private_redis):
    with Registry(private_redis.url, "routes") as registry:
        records = RouteRecords(registry, ttl_s=60)

        async def go():
            before = _route_commands(private_redis.url)
            for i in range(5):
                records.record(f"b{i}", "gw-1", "10.0.0.1:1", None)
            await records.settle()
            written = [registry.get_route(f"b{i}") for i in range(5)]
            for i in range(5):
                records.forget(f"b{i}")
            await records.settle()
            return before, written

        before, written = asyncio.run(go())
        assert written == [ROUTE] * 5
        assert all(registry.get_route(f"b{i}") is None for i in range(5))
        assert _route_commands(private_redis.url) - before == 10  # 5 SETs, then 5 DELs, in two pipelines
        assert not records._stored


def test_a_migrated_request_keeps_its_latest_route(private_redis):
    with Registry(private_redis.url, "routes") as registry:
        records = RouteRecords(registry, ttl_s=60)

        async def go():
            records.record("r4", "gw-1", "10.0.0.1:1", None)
            records.record("r4", "gw-2", "10.0.0.2:1", None)  # routed again before the flush
            await records.settle()
            first = registry.get_route("r4")
            records.record("r4", "gw-3", "10.0.0.3:1", None)  # and again after it
            await records.settle()
            return first, registry.get_route("r4")

        first, latest = asyncio.run(go())
        assert first["decode"] == "10.0.0.2:1" and latest["decode"] == "10.0.0.3:1"
