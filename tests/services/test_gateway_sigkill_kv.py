"""A gateway process killed with SIGKILL mid-request: every worker frees that request's KV by
seeing its calls cancelled (a dead process's connections close), never by a lease running out
(issue 11, acceptance 1; the fault table's `sigkill-gateway` row).

The gateway here is a real process (tests/services/gateway_process.py) in front of a real decode
and prefill worker (MiniCluster, in this process, with a 600 s lease). Each test brings one
request to one phase, SIGKILLs the gateway there and polls (generously) until decode and
prefill are back at their baseline, then checks that no lease expired on the way:

    after Reserve's answer, before Generate / Prefill   (the gateway's after_reserve hook parks it)
    Generate claimed the reservation, prefill computing (prefill's engine thread held)
    decode streaming tokens                             (a long request, committed on decode)

Before ReserveAndHold, the first phase kept decode's blocks until the lease (30 s by default):
nothing else knew that the reservation's owner was gone.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.engine.engine_helpers import random_prompts
from tests.services.gateway_helpers import MiniCluster

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]
ROOT = Path(__file__).resolve().parents[2]
LONG_LEASE_S = 600.0
POLL_S = 60.0  # far under the lease: a pool back within it was not freed by the lease


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url) -> Iterator[MiniCluster]:
    cluster = MiniCluster(tiny_model, redis_url)
    cluster.decode.table.default_lease_s = LONG_LEASE_S
    cluster.redis_url = redis_url  # for the gateway process
    yield cluster
    cluster.close()


class GatewayProcess:
    """tests/services/gateway_process.py; `lines` gets what it prints."""

    def __init__(self, mini: MiniCluster, *, pause_after_reserve: bool = False) -> None:
        argv = [sys.executable, "-m", "tests.services.gateway_process", str(mini.model), mini.redis_url, mini.cluster]
        self.proc = subprocess.Popen(argv + (["--pause-after-reserve"] if pause_after_reserve else []), cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.http_port = int(self.expect("HTTP "))
        deadline = time.monotonic() + 120
        while httpx.get(f"http://127.0.0.1:{self.http_port}/health").status_code != 200:
            assert time.monotonic() < deadline, "the gateway process never saw a healthy decode worker"
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line.startswith(prefix):
                return line[len(prefix):]

    def send(self, prompt: list[int], max_tokens: int) -> threading.Thread:
        """The request, from a thread (its connection breaks when the process dies)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}

        def go() -> None:
            try:
                httpx.post(f"http://127.0.0.1:{self.http_port}/v1/completions", json=body, timeout=300)
            except httpx.HTTPError:
                pass  # expected: the gateway dies mid-request

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _expired(mini: MiniCluster) -> float:
    metrics = mini.decode.table.metrics
    return metrics.registry.get_sample_value("tandem_kv_transfer_failures_total", {"reason": "expired"}) or 0.0


def _prefill_idle(mini: MiniCluster) -> bool:
    def idle(engine) -> bool:
        engine.check_integrity()
        return not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks

    return mini.run(lambda: mini.prefill.engine_loop.call(idle)) and not len(mini.prefill.table)


def _wait(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + POLL_S
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {POLL_S:g} s: {what}"
        time.sleep(0.05)


def _assert_freed_by_cancellation(mini: MiniCluster, expired_before: float) -> None:
    assert mini.decode_at_baseline(timeout=POLL_S), "decode kept KV of the dead gateway's request"
    _wait(lambda: _prefill_idle(mini), "prefill back at its baseline")
    assert _expired(mini) == expired_before, "a reservation was freed by its lease, not by the gateway's death"


def _prompt(seed: int) -> list[int]:
    return random_prompts([45], vocab=1000, seed=seed)[0]


def test_killed_after_reserve_before_generate(mini):
    """Decode answered the Reserve; the gateway dies before opening Generate or Prefill."""
    gateway = GatewayProcess(mini, pause_after_reserve=True)
    try:
        expired = _expired(mini)
        gateway.send(_prompt(41), 8)
        internal_id = gateway.expect("RESERVED ")
        pending = mini.decode.table.pending.get(internal_id)
        assert pending is not None and not pending.attached, "the request is not parked between Reserve and Generate"
        gateway.kill()
        _assert_freed_by_cancellation(mini, expired)
    finally:
        gateway.close()


def test_killed_while_prefill_computes(mini):
    """Generate claimed the reservation and waits for the KV; prefill's engine is busy (held)."""
    gateway = GatewayProcess(mini)
    entered, release = threading.Event(), threading.Event()

    def hold(engine) -> None:
        entered.set()
        release.wait(POLL_S * 4)

    held = asyncio.run_coroutine_threadsafe(mini.prefill.engine_loop.call(hold), mini.loop)
    try:
        _wait(entered.is_set, "prefill's engine thread held")
        expired = _expired(mini)
        gateway.send(_prompt(42), 8)
        _wait(lambda: any(p.attached for p in list(mini.decode.table.pending.values())) and len(mini.prefill.table),
              "decode's Generate waiting for KV, prefill holding the request")
        gateway.kill()
        release.set()
        _assert_freed_by_cancellation(mini, expired)
    finally:
        release.set()
        gateway.close()
        held.result(POLL_S)


def test_killed_while_decode_streams(mini):
    """The request runs on decode (committed), streaming tokens, when the gateway dies."""
    gateway = GatewayProcess(mini)
    try:
        expired = _expired(mini)
        gateway.send(_prompt(43), 400)

        def streaming() -> bool:
            return not mini.decode.table.pending and mini.run(lambda: mini.decode.loop.call(
                lambda e: e.has_unfinished_requests()))

        _wait(streaming, "the request committed on decode, generating")
        gateway.kill()
        _assert_freed_by_cancellation(mini, expired)
    finally:
        gateway.close()


def test_a_decode_worker_without_reserve_and_hold_is_reserved_with_reserve():
    """Rolling upgrade: a decode worker older than ReserveAndHold answers it UNIMPLEMENTED; the
    gateway then reserves with the unary Reserve (held by the lease alone, as before)."""
    import grpc

    from services.gateway.workers import DecodeClient, WorkerChannels
    from tandem.v1 import decode_pb2, decode_pb2_grpc

    class OlderDecode(decode_pb2_grpc.DecodeServicer):  # ReserveAndHold: the base's UNIMPLEMENTED
        async def Reserve(self, request, context):
            return decode_pb2.ReserveResponse(status=decode_pb2.RESERVE_STATUS_RESERVED, dest_block_ids=[7, 8],
                                              block_size=16)

    async def go():
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServicer_to_server(OlderDecode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = WorkerChannels()
        try:
            return await DecodeClient(channels, f"127.0.0.1:{port}").reserve("old", [1, 2, 3], timeout_s=30)
        finally:
            await channels.close()
            await server.stop(0)

    reservation = asyncio.run(go())
    assert reservation.status == "reserved" and reservation.dest_block_ids == (7, 8) and reservation.hold is None
