"""Worker-side fault handling: a hung engine turns grpc.health.v1 NOT_SERVING (and back), a
drain leaves the registry and health first and lets in-flight streams finish, a SIGTERMed worker
exits 0, and a migrated request's resume count is checked at decode's edge."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading

import grpc
import pytest

from services.launcher.cluster import Cluster
from services.runtime.health_probe import check_grpc
from services.runtime.registry import Registry
from tests.cluster.cluster_helpers import wait_for
from tests.faults.fault_table import cluster_whole, standby_ready
from tests.services.decode_helpers import DecodeHarness, collect, decode_request, decode_settings


def _serving(address: str) -> bool:
    return check_grpc(address, timeout=10.0)[0]


def _block_engine(harness: DecodeHarness) -> threading.Event:
    """Parks the engine thread inside a command until the returned event is set (a hung step)."""
    gate = threading.Event()
    asyncio.run_coroutine_threadsafe(harness.handle.loop.call(lambda engine: gate.wait(120)), harness.aloop)
    return gate


def test_a_hung_engine_reports_not_serving_until_it_recovers(tiny_model) -> None:
    settings = decode_settings(tiny_model)
    settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, engine_stall_timeout=0.3))
    harness = DecodeHarness(settings)
    try:
        address = harness.handle.address
        assert _serving(address)
        gate = _block_engine(harness)
        try:
            wait_for(lambda: not _serving(address), timeout_s=60, what="NOT_SERVING while the engine hangs")
        finally:
            gate.set()
        wait_for(lambda: _serving(address), timeout_s=60, what="SERVING again once the engine is back")
    finally:
        harness.close()


def test_drain_deregisters_and_goes_not_serving_first_then_lets_streams_finish(tiny_model, redis_url) -> None:
    harness = DecodeHarness(decode_settings(tiny_model, redis_url=redis_url, cluster="drain-test"))
    registry = Registry(redis_url, "drain-test")
    try:
        address, worker_id = harness.handle.address, harness.handle.worker_id
        wait_for(lambda: registry.get_worker(worker_id) is not None, timeout_s=60, what="registered")
        gate = _block_engine(harness)  # the stream below cannot finish before we look

        async def generate():
            return await collect(harness.decode.Generate(decode_request("drain-1", list(range(10, 40)), 40,
                                                                        remote=False)))  # fmt: skip

        stream = asyncio.run_coroutine_threadsafe(generate(), harness.aloop)
        wait_for(lambda: harness.handle.loop.is_streaming("drain-1"), timeout_s=60, what="stream admitted")
        drained = asyncio.run_coroutine_threadsafe(harness.handle.drain(grace_s=120), harness.aloop)
        try:
            wait_for(lambda: registry.get_worker(worker_id) is None, timeout_s=60, what="deregistered")
            wait_for(lambda: not _serving(address), timeout_s=60, what="NOT_SERVING")
            assert not stream.done() and not drained.done()  # in flight, still being served
        finally:
            gate.set()
        assert len(stream.result(timeout=120).tokens[0]) == 40  # the in-flight stream finished in full
        drained.result(timeout=120)
    finally:
        registry.close()
        harness.close()


def test_resumed_output_count_is_checked_at_decodes_edge(tiny_model) -> None:
    harness = DecodeHarness(decode_settings(tiny_model))
    try:
        bad = decode_request("resume-bad", [11, 12, 13], 4, remote=False)
        bad.num_resumed_output_tokens = 3
        with pytest.raises(grpc.aio.AioRpcError) as info:
            harness.run(lambda: collect(harness.decode.Generate(bad)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_resumed_output_tokens" in info.value.details()
    finally:
        harness.close()


def test_sigterm_drains_and_exits_0_then_the_healer_restarts_it(fault_cluster: Cluster) -> None:
    cluster = fault_cluster
    wait_for(lambda: cluster_whole(cluster) and standby_ready(cluster), timeout_s=600, what="cluster whole")
    decode = cluster.service("decode", 1)
    restarts = decode.restarts
    assert cluster.kill("decode", 1, signal.SIGTERM) == 0
    wait_for(lambda: decode.restarts == restarts + 1 and cluster_whole(cluster), timeout_s=180,
             what="decode-1 restarted and the cluster whole")  # fmt: skip

    def status_shows_it() -> bool:  # what `tandem status` prints comes from the launcher record
        with Registry(cluster.redis_url, cluster.cluster) as registry:
            doc = registry.get_launcher()
        service = (doc or {}).get("services", {}).get("decode-1", {})
        return service.get("restarts") == restarts + 1 and 0 in service.get("exit_codes", [])

    wait_for(status_shows_it, timeout_s=120, what="the launcher record shows the restart")


def test_a_hung_draft_worker_reports_not_serving_until_it_recovers(tiny_model) -> None:
    from services.draft.server import serve as serve_draft
    from tests.services.test_draft_service import draft_settings

    settings = draft_settings(tiny_model)
    settings = dataclasses.replace(settings, engine=dataclasses.replace(settings.engine, engine_stall_timeout=0.3))
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    handle = asyncio.run_coroutine_threadsafe(serve_draft(settings), aloop).result(120)
    gate = threading.Event()
    try:
        assert _serving(handle.address)
        asyncio.run_coroutine_threadsafe(handle.loop.call(lambda worker: gate.wait(120)), aloop)
        try:
            wait_for(lambda: not _serving(handle.address), timeout_s=60, what="NOT_SERVING while the draft hangs")
        finally:
            gate.set()
        wait_for(lambda: _serving(handle.address), timeout_s=60, what="SERVING again")
    finally:
        gate.set()
        asyncio.run_coroutine_threadsafe(handle.stop(), aloop).result(60)
        aloop.call_soon_threadsafe(aloop.stop)
