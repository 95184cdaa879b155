"""EngineLoop: the engine on its own thread, streamed from asyncio."""

from __future__ import annotations

import asyncio

import pytest

from common.engine.llm_engine import RequestError
from services.runtime.engine_loop import EngineLoop
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_greedy, make_engine


@pytest.fixture
def engine_loop(tiny_model):
    loop = EngineLoop(make_engine(tiny_model, budget=16))
    loop.start()
    yield loop
    loop.stop()


def test_concurrent_streams_match_transformers(engine_loop, tiny_model):
    prompts = [[11, 12, 13], list(range(20, 70)), [99] * 5]

    async def one(i, p):
        toks = []
        async for out in engine_loop.generate(f"r{i}", params=greedy(6), prompt_token_ids=p):
            toks.extend(out.new_token_ids)
        return toks

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    assert asyncio.run(main()) == hf_greedy(tiny_model, prompts, 6)
    asyncio.run(engine_loop.call(lambda e: assert_no_leaks(e)))


def test_leaving_a_stream_aborts_the_request(engine_loop):
    async def main():
        agen = engine_loop.generate("x", params=greedy(500), prompt_token_ids=list(range(10, 200)))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if not await engine_loop.call(lambda e: e.has_unfinished_requests()):
                break
            await asyncio.sleep(0.02)
        await engine_loop.call(assert_no_leaks)

    asyncio.run(main())


def test_bad_request_raises_before_streaming(engine_loop):
    async def main():
        with pytest.raises(RequestError):
            async for _ in engine_loop.generate("bad", params=greedy(4), prompt_token_ids=[]):
                pass

    asyncio.run(main())
