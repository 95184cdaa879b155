"""Prefill worker over real gRPC into a real KV receiver engine, then decode there.

The prefill engine is the one `serve()` builds from settings; the receiver is a real LLMEngine
behind a real KVTransfer server (tests/services/prefill_helpers.py).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import grpc
import pytest

from services.prefill.main import serve
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_greedy, make_engine, random_prompts
from tests.services.prefill_helpers import prefill_chunks, prefill_settings, start_receiver
from tandem.v1 import prefill_pb2_grpc

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

MAX_TOKENS = 6
PIECE_LIMIT = 16 << 10  # the receiver asks for small pieces so chunks split into many


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow_steps(engine, delay_s: float, log: list):
    """Wraps the service's on_computed hook: each model pass takes delay_s longer (a bigger model),
    and the end of every pass is logged (time, spans)."""
    hook = engine.on_computed

    def slowed(spans):
        time.sleep(delay_s)
        log.append((time.monotonic(), [(s.request_id, s.start, s.end) for s in spans]))
        hook(spans)

    engine.on_computed = slowed


async def prefill(stub, chunks) -> list:
    return [msg async for msg in stub.Prefill(iter(list(chunks)))]


async def wait_idle(engine_loop, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while await engine_loop.call(lambda e: e.has_unfinished_requests()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    await engine_loop.call(assert_no_leaks)


def test_prefill_ships_kv_that_decodes_like_local_and_transformers(tiny_model):
    metrics_port = free_port()
    prompts = random_prompts([100, 70], vocab=512, seed=1)
    expected = hf_greedy(tiny_model, prompts, MAX_TOKENS)

    async def main():
        handle = await serve(prefill_settings(tiny_model, budget=16, metrics_port=metrics_port), grpc_port=0)
        steps: list = []
        slow_steps(handle.engine, 0.02, steps)
        receiver, server, address = await start_receiver(
            make_engine(tiny_model, prefix_caching=False, num_blocks=64), "tiny", PIECE_LIMIT
        )
        channel = grpc.aio.insecure_channel(handle.address)
        stub = prefill_pb2_grpc.PrefillStub(channel)
        try:
            async def one(rid, prompt):
                reservation = await receiver.reserve(rid, prompt, greedy(MAX_TOKENS))
                progress = await prefill(stub, prefill_chunks(rid, prompt, reservation, address))
                return progress, await receiver.tokens(rid)

            results = await asyncio.gather(one("a", prompts[0]), one("b", prompts[1]))
            again = await one("a2", prompts[0])  # prefill's own prefix cache serves most of it
            local = await receiver.engine_loop.call(lambda e: e.generate(prompts, greedy(MAX_TOKENS)))
            await wait_idle(handle.engine_loop)
            await wait_idle(receiver.engine_loop)
            body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
            return results, again, local, steps, receiver.pieces, body
        finally:
            await channel.close()
            await handle.stop()
            await server.stop(None)
            receiver.engine_loop.stop()

    results, again, local, steps, pieces, metrics = asyncio.run(main())
    tokens = [t for _, t in results]
    assert tokens == expected, "disaggregated output differs from transformers"
    assert tokens == [choice[0].token_ids for choice in local], "disaggregated output differs from local prefill"
    assert again[1] == expected[0]

    for (progress, toks), prompt in zip(results, prompts):
        done = progress[-1]
        assert done.done and [t.token_id for t in done.first_tokens] == toks[:1]
        computed = [p.num_computed_tokens for p in progress[:-1]]
        assert computed == sorted(computed) and computed[-1] == len(prompt)
        assert len(computed) >= len(prompt) // 16, "the 16-token budget splits the prompt into steps"
        assert done.kv_bytes_sent > 0
    assert again[0][-1].num_cached_tokens == 96, "second run of prompt a hits prefill's prefix cache"

    # Every piece fits the receiver's limit (far below gRPC's 4 MiB); blocks were split into many.
    assert all(p.message_bytes < PIECE_LIMIT + 1024 < 4 << 20 for p in pieces)
    assert sum(p.request_id == "a" for p in pieces) > 10

    # Overlap: decode held request a's first piece before prefill finished computing a's prompt.
    last_a = max(t for t, spans in steps if any(r == "a" and e == len(prompts[0]) for r, _, e in spans))
    first_piece_a = min(p.arrived_at for p in pieces if p.request_id == "a")
    assert first_piece_a < last_a, "KV of early chunks must ship while later chunks compute"

    computed_total = len(prompts[0]) + len(prompts[1]) + (len(prompts[0]) - 96)
    assert f"tandem_prefill_tokens_total {float(computed_total)}" in metrics
    sent = [line for line in metrics.splitlines() if line.startswith('tandem_kv_transfer_bytes_total{direction="send"}')]
    assert sent and float(sent[0].split()[-1]) > 0
    assert 'tandem_kv_transfer_seconds_count{direction="send"}' in metrics


def test_only_blocks_past_the_decode_prefix_are_sent(tiny_model):
    prefix = random_prompts([48], vocab=512, seed=2)[0]
    prompt = prefix + random_prompts([37], vocab=512, seed=3)[0]

    async def main():
        handle = await serve(prefill_settings(tiny_model, budget=32), grpc_port=0)
        receiver, server, address = await start_receiver(make_engine(tiny_model, num_blocks=64), "tiny")
        channel = grpc.aio.insecure_channel(handle.address)
        try:
            await receiver.engine_loop.call(lambda e: e.generate([prefix + [7]], greedy(1)))  # decode caches 3 blocks
            reservation = await receiver.reserve("r", prompt, greedy(MAX_TOKENS))
            progress = await prefill(prefill_pb2_grpc.PrefillStub(channel), prefill_chunks("r", prompt, reservation, address))
            tokens = await receiver.tokens("r")
            await wait_idle(handle.engine_loop)
            return reservation, progress, tokens, receiver.pieces
        finally:
            await channel.close()
            await handle.stop()
            await server.stop(None)
            receiver.engine_loop.stop()

    reservation, progress, tokens, pieces = asyncio.run(main())
    assert reservation.num_cached_tokens == 48
    sent_blocks = {b for p in pieces for b in p.block_ids}
    assert sent_blocks == set(reservation.block_ids[3:]), "exactly the blocks past num_skip_tokens"
    assert progress[-1].done
    assert tokens == hf_greedy(tiny_model, [prompt], MAX_TOKENS)[0]
