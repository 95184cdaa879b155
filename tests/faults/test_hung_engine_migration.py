"""Stall detection through the engine loop, in one process: a decode worker whose engine thread
hangs mid-stream (held on an event: no wall clock decides it) stops answering SERVING, and the
gateway's stall check moves the stream to the other decode worker with exactly the greedy
tokens of an uninterrupted run; with --migration-limit 0 the stream ends with an error event
instead of staying silent (defect 3 of issue 11)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import uuid

import httpx
import pytest

from services.decode.server import serve as serve_decode
from services.gateway.main import serve as serve_gateway
from services.runtime.settings import DecodeSettings
from tests.cluster.cluster_helpers import wait_for
from tests.services.gateway_helpers import _common, _engine, free_port, gateway_settings, served_model

MAX_TOKENS = 300


class TwoDecodes:
    """Two decode workers and an aggregated gateway on one background event loop."""

    def __init__(self, model, redis_url: str, migration_limit: int) -> None:
        self.cluster = f"hung-{uuid.uuid4().hex[:8]}"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        engine = dataclasses.replace(_engine(96), engine_stall_timeout=0.3)
        self.decodes = [self.run(lambda: serve_decode(DecodeSettings(
            common=_common(model, redis_url, self.cluster, free_port()), engine=engine))) for _ in range(2)]
        settings = gateway_settings(model, redis_url, self.cluster, mode="aggregated", stall_timeout=0.5,
                                    migration_limit=migration_limit)  # fmt: skip
        self.gateway = self.run(lambda: serve_gateway(settings, http_port=0, grpc_port=0, model=served_model(model)))
        self.url = f"http://127.0.0.1:{self.gateway.http_port}"
        wait_for(lambda: len(self.gateway.gateway.orchestrator.decode_workers()) == 2, timeout_s=60,
                 what="both decode workers registered")  # fmt: skip

    def run(self, fn, timeout: float = 120.0):
        async def go():
            return await fn()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout)

    def busy(self) -> list[bool]:
        return [self.run(lambda d=d: d.loop.call(lambda e: e.has_unfinished_requests())) for d in self.decodes]

    def hang(self, index: int) -> threading.Event:
        gate = threading.Event()
        asyncio.run_coroutine_threadsafe(self.decodes[index].loop.call(lambda e: gate.wait(300)), self.loop)
        return gate

    def close(self) -> None:
        async def shut() -> None:
            with contextlib.suppress(Exception):  # a test may have stopped it already
                await self.gateway.stop(grace_s=1.0)
            for d in self.decodes:
                await d.stop()

        self.run(shut)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _stream(url: str, prompt: list[int], on_tokens) -> tuple[list[int], str | None, dict | None]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}  # fmt: skip
    tokens, finish, error = [], None, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300.0) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]
                continue
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            on_tokens(tokens)
    return tokens, finish, error


@pytest.mark.parametrize("migration_limit", [3, 0])
def test_a_hung_engine_mid_stream(tiny_model, redis_url, migration_limit: int) -> None:
    c = TwoDecodes(tiny_model, redis_url, migration_limit)
    gates: list[threading.Event] = []
    try:
        prompt = list(range(20, 57))
        expected, finish, error = _stream(c.url, prompt, lambda tokens: None)
        assert finish == "length" and error is None and len(expected) == MAX_TOKENS

        def on_tokens(tokens: list[int]) -> None:
            if len(tokens) >= 5 and not gates:
                serving = c.busy().index(True)  # the worker that runs our stream
                gates.append(c.hang(serving))

        tokens, finish, error = _stream(c.url, prompt, on_tokens)
        if migration_limit:
            assert error is None and finish == "length" and tokens == expected
        else:  # not migrated: the stream ends with an error event, not silence
            assert error is not None and "migration-limit" in error["message"], error
            assert tokens == expected[: len(tokens)]
    finally:
        for gate in gates:
            gate.set()
        c.close()


def test_gateway_drain_lets_an_in_flight_stream_finish(tiny_model, redis_url) -> None:
    """SIGTERM on the gateway (GatewayHandle.stop): /health says draining, a stream in flight
    (held by a paused engine, so it cannot finish first) still gets every token."""
    c = TwoDecodes(tiny_model, redis_url, migration_limit=3)
    gates: list[threading.Event] = []
    stopped = []
    try:
        prompt = list(range(30, 61))

        def on_tokens(tokens: list[int]) -> None:
            if len(tokens) >= 5 and not gates:
                gates.append(c.hang(c.busy().index(True)))
                stopped.append(asyncio.run_coroutine_threadsafe(c.gateway.stop(grace_s=120), c.loop))
                wait_for(lambda: not c.gateway.gateway.health_status()[0], timeout_s=60, what="draining")
                gates[0].set()  # the engine goes on; the stream must still be delivered in full

        tokens, finish, error = _stream(c.url, prompt, on_tokens)
        assert error is None and finish == "length" and len(tokens) == MAX_TOKENS
        stopped[0].result(timeout=120)
    finally:
        for gate in gates:
            gate.set()
        c.close()
