"""Helpers for decode-service tests: a decode worker on its own event-loop thread, a gRPC client on
the same loop, and a stand-in prefill (a second LLMEngine on the same weights) that computes a
prompt's KV and encodes it into KVChunk messages exactly as a prefill worker would."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from common.engine.llm_engine import ComputedSpan, LLMEngine
from common.kv_transfer.codec import encode_kv_chunks
from services.decode.server import DecodeHandle, serve
from services.runtime.engine_factory import kv_layout
from services.runtime.kv_wire import chunk_to_proto, sampling_params_from_dict, token_logprob_to_proto
from services.runtime.settings import CommonSettings, DecodeSettings, EngineSettings
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.engine.engine_helpers import greedy, make_engine

T = TypeVar("T")
MODEL_ID = "tiny-test"
BLOCK_SIZE = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DEFAULT_KV_BLOCKS = 64


def decode_settings(model: Path, *, num_kv_blocks: int = DEFAULT_KV_BLOCKS, lease_s: float = 30.0,
                    redis_url: str | None = None, cluster: str = "tandem", max_num_seqs: int = 16) -> DecodeSettings:  # fmt: skip
    return DecodeSettings(
        common=CommonSettings(model=str(model), served_model_name=MODEL_ID, host="127.0.0.1", grpc_port=free_port(),
                              redis_url=redis_url, cluster=cluster, heartbeat_interval=0.2),  # fmt: skip
        engine=EngineSettings(device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                              max_num_batched_tokens=64, max_num_seqs=max_num_seqs, torch_threads=1),  # fmt: skip
        kv_lease_seconds=lease_s,
    )


class DecodeHarness:
    """A decode worker served on a private event loop thread; `run(coro_fn)` executes there."""

    def __init__(self, settings: DecodeSettings) -> None:
        self.aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.aloop.run_forever, name="decode-test-loop", daemon=True)
        self._thread.start()
        self.handle: DecodeHandle = self.run(lambda: serve(settings))
        self.channel: grpc.aio.Channel = self.run(self._open_channel)
        self.decode = decode_pb2_grpc.DecodeStub(self.channel)
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(self.channel)

    async def _open_channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.handle.address)

    def run(self, coro_fn: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
        """Calls coro_fn on the harness loop (gRPC calls must be made there) and awaits it."""

        async def on_loop() -> T:
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self.aloop).result(timeout)

    def engine_call(self, fn: Callable[[LLMEngine], T]) -> T:
        async def go() -> T:
            return await self.handle.loop.call(fn)

        return self.run(go)

    def baseline_reached(self, timeout: float = 5.0) -> bool:
        """Every request gone and every block back on the free list (prefix-cache blocks count as free)."""
        deadline = time.monotonic() + timeout
        while True:
            ok = self.engine_call(_idle_and_intact) and not self.handle.table.pending
            if ok or time.monotonic() > deadline:
                return ok
            time.sleep(0.05)

    def close(self) -> None:
        async def shut() -> None:
            await self.channel.close()
            await self.handle.stop()

        self.run(shut)
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        self._thread.join(5)


def _idle_and_intact(engine: LLMEngine) -> bool:
    engine.check_integrity()
    return not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks


# -- requests ----------------------------------------------------------------------------------------
def decode_request(rid: str, prompt: list[int], max_tokens: int, *, remote: bool,
                   fail: bool = False, **sampling: Any) -> decode_pb2.DecodeRequest:  # fmt: skip
    params = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, **sampling}
    return decode_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=sampling_params_from_dict(params),
        kv_source=decode_pb2.KV_SOURCE_REMOTE if remote else decode_pb2.KV_SOURCE_LOCAL,
        kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_FAIL if fail else decode_pb2.KV_FAILURE_POLICY_RECOMPUTE,
    )  # fmt: skip


@dataclass
class StreamResult:
    tokens: dict[int, list[int]]
    messages: list[decode_pb2.DecodeResponse]

    @property
    def usage(self) -> common_pb2.Usage:
        return self.messages[-1].usage

    @property
    def kv_source_used(self) -> int:
        return self.messages[0].kv_source_used


async def collect(call) -> StreamResult:
    tokens: dict[int, list[int]] = {}
    messages = []
    async for msg in call:
        messages.append(msg)
        for choice in msg.choices:
            got = tokens.setdefault(choice.choice_index, [])
            assert choice.output_index == len(got) or not choice.token_ids, "output_index out of order"
            got.extend(choice.token_ids)
    return StreamResult(tokens, messages)


# -- the stand-in prefill -------------------------------------------------------------------------------
@dataclass
class PrefilledPrompt:
    kv: torch.Tensor
    """[num_layers, 2, num_prompt_blocks, block_size, kv_heads, head_dim] of the whole prompt."""
    first_token: int
    first_logprob: float


class StandInPrefill:
    """A second engine on the same weights: computes the prompt, keeps its KV, samples token 0."""

    def __init__(self, model: Path) -> None:
        self.engine = make_engine(model, num_blocks=64, block_size=BLOCK_SIZE, prefix_caching=False)
        self.layout = kv_layout(self.engine, MODEL_ID)
        self._captured: dict[str, torch.Tensor] = {}
        self.engine.on_computed = self._on_computed

    def _on_computed(self, spans: list[ComputedSpan]) -> None:
        for span in spans:  # runs before the request is freed: its blocks still hold the prompt's KV
            self._captured[span.request_id] = self.engine.kv_cache.read_blocks(span.block_ids)

    def prefill(self, rid: str, prompt: list[int]) -> PrefilledPrompt:
        self.engine.add_request(rid, params=greedy(1), prompt_token_ids=prompt)
        outs = []
        while self.engine.has_unfinished_requests():
            outs += self.engine.step()
        kv = self._captured.pop(rid)
        n_blocks = -(-len(prompt) // BLOCK_SIZE)
        return PrefilledPrompt(kv[:, :, :n_blocks].clone(), outs[-1].new_token_ids[0], outs[-1].new_logprobs[0][0])

    def chunks(self, rid: str, prompt: list[int], reserve: decode_pb2.ReserveResponse, *,
               max_payload_bytes: int = 16 << 10) -> list[kv_transfer_pb2.KVChunk]:  # fmt: skip
        """The KVChunk messages prefill would push for this reservation (only past num_cached_tokens)."""
        done = self.prefill(rid, prompt)
        skip = reserve.num_cached_tokens // BLOCK_SIZE
        kv = done.kv[:, :, skip:]
        pieces = list(encode_kv_chunks(kv, list(reserve.dest_block_ids), request_id=rid,
                                       max_payload_bytes=max_payload_bytes))  # fmt: skip
        first = [token_logprob_to_proto(done.first_token, done.first_logprob)]
        h = self.layout.compatibility_hash()
        return [chunk_to_proto(p, compatibility_hash=h, first_tokens=first if p.is_last else ()) for p in pieces]


async def push(kv_stub, messages: Iterable[kv_transfer_pb2.KVChunk]) -> kv_transfer_pb2.PushKVResponse:
    async def gen():
        for m in messages:
            yield m

    return await kv_stub.PushKV(gen())


async def poll_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    """Awaits until predicate() is truthy, checking every 10 ms; fails naming `what` after a
    generous bound (a hang, not a slow machine)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)
