"""The registry against a real redis-server: records, TTLs, routes, heartbeats, outages."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.runtime.redis_server import RedisServerProcess
from services.runtime.registry import (
    AsyncHeartbeater,
    CachedRegistryView,
    Heartbeater,
    KeySchema,
    Registry,
    RegistryDataError,
    RegistryUnavailable,
    Role,
    WorkerInfo,
    WorkerLoad,
    redact_url,
)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    # Generous: a loaded machine may take seconds; a condition that holds returns at once.
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.01)


def worker(wid: str = "d0", role: str = "decode", **load: int) -> WorkerInfo:
    return WorkerInfo(wid, role, "127.0.0.1:5000", "tiny", version="0.1.0", **load)


# -- records -------------------------------------------------------------------------------------
def test_worker_info_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="role"):
        worker(role="router")
    with pytest.raises(ValueError, match="address"):
        WorkerInfo("d0", "decode", "no-port", "m")
    with pytest.raises(ValueError, match="num_running"):
        worker(num_running=-1)
    with pytest.raises(ValueError, match="kv_blocks_free"):
        worker(kv_blocks_free=5, kv_blocks_total=4)
    with pytest.raises(ValueError, match="worker_id"):
        worker(wid="")


def test_worker_info_json_round_trip_ignores_unknown_fields() -> None:
    info = worker(kv_blocks_free=3, kv_blocks_total=8)
    info = WorkerInfo.from_dict({**info.to_dict(), "extra": {"spec_acceptance_rate": 0.5}})
    assert WorkerInfo.from_json(info.to_json()) == info
    assert WorkerInfo.from_json(info.to_json()[:-1] + ',"added_later":1}') == info
    assert info.kv_blocks_used == 5 and info.kv_usage == pytest.approx(5 / 8)
    with pytest.raises(RegistryDataError):
        WorkerInfo.from_json("{not json")


def test_key_schema_and_redaction() -> None:
    keys = KeySchema("prod")
    assert keys.worker("d0") == "prod:worker:d0"
    assert keys.role_index(Role.DECODE) == "prod:workers:decode"
    assert keys.route("r1") == "prod:route:r1"
    with pytest.raises(ValueError):
        KeySchema("has space")
    assert redact_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


# -- register / list / expire ------------------------------------------------------------------------
def test_register_list_and_filter_by_role(registry: Registry) -> None:
    registry.register(worker("d1", kv_blocks_free=4, kv_blocks_total=8), ttl_s=5)
    registry.register(worker("d0"), ttl_s=5)
    registry.register(worker("p0", role="prefill", queued_tokens=12), ttl_s=5)
    registry.register(worker("g0", role="gateway"), ttl_s=5)
    assert [(w.role.value, w.worker_id) for w in registry.list_workers()] == [
        ("gateway", "g0"), ("prefill", "p0"), ("decode", "d0"), ("decode", "d1")
    ]
    assert [w.worker_id for w in registry.list_workers("decode")] == ["d0", "d1"]
    assert registry.list_workers(Role.DRAFT) == []
    d1 = registry.get_worker("d1")
    assert d1 is not None and d1.kv_blocks_free == 4 and d1.updated_at > 0
    assert registry.get_worker("nobody") is None


def test_ttl_lapse_removes_worker_and_prunes_index(registry: Registry) -> None:
    registry.register(worker("short"), ttl_s=0.2)
    registry.register(worker("long"), ttl_s=10)
    index = registry.keys.role_index("decode")
    assert registry.client.zcard(index) == 2
    wait_for(lambda: registry.client.exists(registry.keys.worker("short")) == 0)
    assert [w.worker_id for w in registry.list_workers()] == ["long"]
    assert registry.client.zrange(index, 0, -1) == ["long"]  # stale entry pruned on read


def test_heartbeat_updates_load_and_ttl(registry: Registry) -> None:
    first = registry.register(worker(kv_blocks_free=10, kv_blocks_total=10), ttl_s=0.5)
    time.sleep(0.01)
    second = registry.heartbeat(first.with_load(WorkerLoad(6, 10, 2, 1, 0, {"spec_acceptance_rate": 0.7})), 5)
    assert second.updated_at > first.updated_at
    (seen,) = registry.list_workers()
    assert (seen.kv_blocks_free, seen.num_running, seen.num_waiting) == (6, 2, 1)
    assert seen.extra == {"spec_acceptance_rate": 0.7}
    assert seen.started_at == first.started_at
    assert registry.client.pttl(registry.keys.worker("d0")) > 1000  # TTL reset to 5 s


def test_deregister(registry: Registry) -> None:
    registry.register(worker(), ttl_s=5)
    assert registry.deregister("d0") is True
    assert registry.list_workers() == []
    assert registry.client.zcard(registry.keys.role_index("decode")) == 0
    assert registry.deregister("d0") is False


def test_undecodable_record_is_skipped(registry: Registry, caplog: pytest.LogCaptureFixture) -> None:
    registry.register(worker("good"), ttl_s=5)
    registry.register(worker("bad"), ttl_s=5)
    registry.client.set(registry.keys.worker("bad"), "{garbage", px=5000)
    with caplog.at_level(logging.WARNING):
        assert [w.worker_id for w in registry.list_workers()] == ["good"]
    assert "bad" in caplog.text


def test_namespaces_are_isolated(redis_url: str, registry: Registry) -> None:
    registry.register(worker(), ttl_s=5)
    with Registry(redis_url, registry.cluster + "-other") as other:
        assert other.list_workers() == []
    assert all(k.startswith(registry.keys.prefix) for k in registry.client.scan_iter(f"{registry.cluster}*"))


# -- routes ----------------------------------------------------------------------------------------
def test_routes_with_ttl(registry: Registry) -> None:
    registry.record_route("r1", {"prefill": "p0", "decode": "d0", "blocks": [1, 2]}, ttl_s=0.2)
    registry.record_route("r2", {"decode": "d1"}, ttl_s=10)
    assert registry.get_route("r1") == {"prefill": "p0", "decode": "d0", "blocks": [1, 2]}
    assert registry.delete_route("r2") is True
    assert registry.get_route("r2") is None
    assert registry.delete_route("r2") is False
    wait_for(lambda: registry.get_route("r1") is None)
    with pytest.raises(ValueError):
        registry.record_route("r3", {}, ttl_s=0)


# -- heartbeaters ----------------------------------------------------------------------------------
def test_heartbeater_reports_fresh_load(registry: Registry) -> None:
    calls = {"n": 0}

    def load() -> WorkerLoad:
        calls["n"] += 1
        return WorkerLoad(kv_blocks_free=10 - calls["n"] % 10, kv_blocks_total=10, num_running=calls["n"])

    with Heartbeater(registry, worker(), load, interval_s=0.05) as hb:
        wait_for(lambda: hb.num_beats >= 3)
        wait_for(lambda: (registry.get_worker("d0") or worker()).num_running >= 3)
        assert hb.ttl_s == pytest.approx(0.15)
    assert registry.list_workers() == []  # stop() deregisters


def test_heartbeater_survives_broken_load_callback(registry: Registry) -> None:
    def load() -> WorkerLoad:
        raise RuntimeError("engine busy")

    with Heartbeater(registry, worker(), load, interval_s=0.05) as hb:
        wait_for(lambda: hb.num_beats >= 2)  # keeps the last known record alive
        assert registry.get_worker("d0") is not None


def test_heartbeater_survives_outage_and_reregisters(private_redis: RedisServerProcess,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    registry = Registry(private_redis.url, "outage", socket_timeout_s=0.2, retries=0)
    load = WorkerLoad(kv_blocks_free=7, kv_blocks_total=9)
    with caplog.at_level(logging.WARNING, logger="services.runtime.registry"):
        hb = Heartbeater(registry, worker(), lambda: load, interval_s=0.05, max_backoff_s=0.2).start()
        wait_for(lambda: hb.num_beats >= 1)
        private_redis.stop()
        wait_for(lambda: hb.consecutive_failures >= 3)
        with pytest.raises(RegistryUnavailable, match="unreachable"):
            registry.list_workers()
        private_redis.start()  # same port, empty
        # The record is back once a heartbeat's write landed; the heartbeater counts the success
        # just after that write returns, so wait for both (a loaded machine may see one alone).
        wait_for(lambda: [w.worker_id for w in registry.list_workers()] == ["d0"] and hb.consecutive_failures == 0)
    assert registry.get_worker("d0").kv_blocks_free == 7  # type: ignore[union-attr]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "heartbeat" in r.getMessage()]
    assert len(warnings) == 1, "an outage is logged once, not once per retry"
    hb.stop()
    registry.close()


def test_async_heartbeater(registry: Registry) -> None:
    async def scenario() -> None:
        beats = {"n": 0}

        async def load() -> WorkerLoad:
            beats["n"] += 1
            return WorkerLoad(kv_blocks_free=1, kv_blocks_total=4, num_waiting=beats["n"])

        async with AsyncHeartbeater(registry, worker("a0"), load, interval_s=0.05) as hb:
            while hb.num_beats < 3:
                await asyncio.sleep(0.01)
            seen = registry.get_worker("a0")
            assert seen is not None and seen.num_waiting >= 1 and seen.kv_blocks_total == 4
        assert registry.get_worker("a0") is None

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))


def test_async_heartbeater_stamps_when_the_load_was_read(registry: Registry) -> None:
    """load_at is taken before the load callback runs, so a slow read (a long engine step)
    never looks newer than requests routed while it ran."""
    async def scenario() -> None:
        entered: list[float] = []

        async def slow_load() -> WorkerLoad:
            entered.append(time.time())
            await asyncio.sleep(0.05)
            return WorkerLoad(kv_blocks_free=1, kv_blocks_total=4)

        hb = AsyncHeartbeater(registry, worker("slow0"), slow_load, interval_s=1.0)
        await hb.beat_once()
        seen = registry.get_worker("slow0")
        assert seen is not None and 0 < seen.load_at <= entered[0] < seen.updated_at
        await hb.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_async_heartbeater_beats_on_while_the_load_read_is_slow(registry: Registry) -> None:
    """A load read held up (a long engine step on a loaded machine) does not stop the beats:
    the record is rewritten with the last load, and the one read in flight is reused rather
    than piled up. With the engine judged hung (alive() false) no beat is written."""
    async def scenario() -> None:
        release = asyncio.Event()
        calls = {"n": 0}
        alive = {"engine": True}

        async def load() -> WorkerLoad:
            calls["n"] += 1
            if calls["n"] > 1:
                await release.wait()
            return WorkerLoad(kv_blocks_free=1, kv_blocks_total=4, num_waiting=calls["n"])

        hb = AsyncHeartbeater(registry, worker("held0"), load, interval_s=0.05, alive=lambda: alive["engine"])
        await hb.beat_once()
        first = registry.get_worker("held0")
        assert first is not None and first.num_waiting == 1
        await hb.beat_once()  # the read is held: the last load is written again
        second = registry.get_worker("held0")
        assert second is not None and second.num_waiting == 1 and second.load_at == first.load_at
        assert second.updated_at > first.updated_at and hb.num_beats == 2
        alive["engine"] = False
        await hb.beat_once()  # hung engine: nothing written, the record is left to expire
        assert hb.num_beats == 2
        alive["engine"] = True
        release.set()
        await hb.beat_once()
        third = registry.get_worker("held0")
        assert third is not None and third.num_waiting == 2 and calls["n"] == 2 and hb.num_beats == 3
        await hb.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=60))


def test_async_heartbeater_writes_with_the_default_executor_full(registry: Registry) -> None:
    """The service's default executor busy (a burst of grammar compiles waiting on one that builds
    the compiler): beats still land, on the heartbeater's own writer thread."""
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        release = threading.Event()
        blockers = [loop.run_in_executor(None, release.wait) for _ in range(4)]
        hb = AsyncHeartbeater(registry, worker("busy0"), lambda: WorkerLoad(kv_blocks_free=3, kv_blocks_total=4),
                              interval_s=0.05)
        try:
            await asyncio.wait_for(hb.beat_once(), timeout=60)  # generous: it hangs for ever without the fix
            seen = registry.get_worker("busy0")
            assert seen is not None and seen.kv_blocks_free == 3
        finally:
            release.set()
            await asyncio.gather(*blockers)
        await hb.stop()

    asyncio.run(asyncio.wait_for(scenario(), timeout=120))


# -- the cached view -----------------------------------------------------------------------------
def test_cached_view_serves_last_list_during_outage_and_recovers(private_redis: RedisServerProcess) -> None:
    registry = Registry(private_redis.url, "view", socket_timeout_s=0.2, retries=0)
    hb = Heartbeater(registry, worker("d0"), interval_s=0.05, max_backoff_s=0.2).start()
    view = CachedRegistryView(registry, refresh_interval_s=0.05, max_backoff_s=0.2, reconnect_grace_s=2.0)
    assert not view.snapshot().connected and view.workers() == []
    view.start()
    wait_for(lambda: [w.worker_id for w in view.workers()] == ["d0"])

    private_redis.stop()
    wait_for(lambda: view.snapshot().error is not None)
    time.sleep(0.2)
    snap = view.snapshot()
    assert not snap.connected and "unreachable" in (snap.error or "")
    assert [w.worker_id for w in snap.workers] == ["d0"]  # still served
    assert [w.worker_id for w in view.workers("decode")] == ["d0"]
    assert snap.age_s() is not None and snap.age_s() >= 0.2

    private_redis.start()
    wait_for(lambda: view.snapshot().connected)
    wait_for(lambda: view.snapshot().carried_over == () and [w.worker_id for w in view.workers()] == ["d0"])
    assert view.snapshot().age_s() < 1.0
    view.stop()
    hb.stop()
    registry.close()


def test_cached_view_carries_workers_over_a_restart_until_they_return(private_redis: RedisServerProcess) -> None:
    registry = Registry(private_redis.url, "grace", socket_timeout_s=0.2, retries=0)
    registry.register(worker("d0"), ttl_s=30)
    registry.register(worker("p0", role="prefill"), ttl_s=30)
    view = CachedRegistryView(registry, refresh_interval_s=0.05, reconnect_grace_s=0.5)
    assert view.refresh()
    private_redis.restart()  # faster than an outage we would notice: detected by the new run_id
    registry.register(worker("d0"), ttl_s=30)  # d0 re-registers; p0 has not yet
    assert view.refresh()
    snap = view.snapshot()
    assert snap.connected and snap.carried_over == ("p0",)
    assert sorted(w.worker_id for w in snap.workers) == ["d0", "p0"]
    time.sleep(0.6)
    assert view.refresh()
    assert [w.worker_id for w in view.workers()] == ["d0"]  # grace over: p0 is gone
    registry.close()


def test_registry_raises_unavailable_fast() -> None:
    server = RedisServerProcess()
    server.start()
    url = server.url
    server.close()
    with Registry(url, "down", socket_timeout_s=0.2, retries=0) as registry:
        start = time.monotonic()
        with pytest.raises(RegistryUnavailable, match="127.0.0.1"):
            registry.heartbeat(worker(), ttl_s=1)
        with pytest.raises(RegistryUnavailable):
            registry.get_route("r1")
        assert time.monotonic() - start < 2.0


def test_no_heartbeat_lands_after_stop(registry: Registry) -> None:
    """A write still in flight when stop() deregisters must not bring the record back."""
    hb = Heartbeater(registry, worker(), interval_s=0.05).start()
    wait_for(lambda: hb.num_beats >= 1)
    hb.stop()
    hb.beat_once()  # what a late thread / to_thread write would do
    assert registry.get_worker("d0") is None
