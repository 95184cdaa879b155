"""EngineLoop: the engine on its own thread, streamed from asyncio."""

from __future__ import annotations

import asyncio
import itertools
import threading

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


def test_a_consumer_that_falls_behind_gets_merged_outputs(engine_loop, tiny_model):
    # After its first output the consumer waits until the engine has finished the request (a
    # slow gRPC writer, at the extreme): what piled up comes as one output, with every token,
    # logprob and the finish, in order. The engine thread holds after the step that made the
    # first output until the consumer has it, so on a loaded machine too the first comes alone.
    # Step listeners run before a step's outputs are handed over, so the hold is in the second
    # step's listener (holding in the first would keep the first output from the consumer).
    prompt = list(range(30, 44))  # within the step budget: the first step makes the first token
    first_taken = threading.Event()
    steps_seen = []

    def hold_after_first_step(engine) -> None:
        if engine.is_unfinished("slow"):
            steps_seen.append(engine.num_steps)
            if len(steps_seen) >= 2 and not first_taken.is_set():
                first_taken.wait(timeout=120)

    engine_loop.step_listeners.append(hold_after_first_step)

    async def main():
        outs = []
        async for out in engine_loop.generate("slow", params=greedy(24, logprobs=0), prompt_token_ids=prompt):
            outs.append(out)
            first_taken.set()
            while await engine_loop.call(lambda e: e.is_unfinished("slow")):
                await asyncio.sleep(0.01)
        return outs

    outs = asyncio.run(main())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == hf_greedy(tiny_model, [prompt], 24)[0]
    assert len(outs) == 2 and len(outs[1].new_token_ids) >= 12  # the first output, then all the rest as one
    assert [len(o.new_logprobs) for o in outs] == [len(o.new_token_ids) for o in outs]
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not any(o.finished for o in outs[:-1])
    assert all(o.token_ids == tokens[: len(o.token_ids)] for o in outs)
    assert [len(o.token_ids) for o in outs] == list(itertools.accumulate(len(o.new_token_ids) for o in outs))
    asyncio.run(engine_loop.call(assert_no_leaks))



class RecordingLoop(EngineLoop):
    """An EngineLoop that records, per hand-over to the streams, each output's token count."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handovers: list[list[int]] = []

    def _dispatch(self, outputs) -> None:
        self.handovers.append([len(o.new_token_ids) for o in outputs])
        super()._dispatch(outputs)


def _generate(loop, request_id, prompt, n):
    async def main():
        return [t async for out in loop.generate(request_id, params=greedy(n), prompt_token_ids=prompt)
                for t in out.new_token_ids]

    return asyncio.run(main())


def test_a_stream_interval_hands_a_run_of_decode_steps_over_at_once(tiny_model):
    # An interval far longer than the run: only the rules end it, never the clock.
    loop = RecordingLoop(make_engine(tiny_model, budget=64), stream_interval_s=60.0)
    loop.start()
    try:
        prompt = list(range(30, 50))
        assert _generate(loop, "r", prompt, 8) == hf_greedy(tiny_model, [prompt], 8)[0]
        # The prompt's step hands its first token over at once; the 7 decode steps go together,
        # ended by the step that finished the request.
        assert loop.handovers == [[1], [1] * 7]
        asyncio.run(loop.call(assert_no_leaks))
    finally:
        loop.stop()


def test_a_command_ends_a_run_of_decode_steps(tiny_model):
    loop = RecordingLoop(make_engine(tiny_model, budget=64), stream_interval_s=60.0)

    def command_after_third_decode_step(engine) -> None:
        if engine.num_steps == 4:  # the prompt's step, then three decode steps
            loop._submit(lambda: None)  # as a new request or an abort arrives, between steps

    loop.step_listeners.append(command_after_third_decode_step)
    loop.start()
    try:
        prompt = list(range(10, 20))
        assert _generate(loop, "r", prompt, 8) == hf_greedy(tiny_model, [prompt], 8)[0]
        assert loop.handovers == [[1], [1] * 3, [1] * 4]
        asyncio.run(loop.call(assert_no_leaks))
    finally:
        loop.stop()


def _first_token_without_text(model, text_tokens, n: int) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output starts with a token that shows no text alone and goes on with
    one that does (found among a few candidates with transformers), and that output."""
    candidates = [list(range(k, k + 12)) for k in range(5, 1000, 37)]
    for prompt, out in zip(candidates, hf_greedy(model, candidates, n)):
        if not text_tokens(out[0]) and text_tokens(out[1]):
            return prompt, out
    pytest.skip("no candidate prompt starts its output without text on this model")


def test_a_first_token_without_text_does_not_hold_back_the_next(tiny_model):
    # A client's first text is its time to first token: when the first token shows no text (a
    # special token, one byte of a character), the next step's token goes out at once instead
    # of waiting out the streaming interval; from then on, the run goes on as usual.
    from transformers import AutoTokenizer

    from common.sampling.text_tokens import TextTokens

    text_tokens = TextTokens(AutoTokenizer.from_pretrained(tiny_model))
    prompt, expected = _first_token_without_text(tiny_model, text_tokens, 8)
    loop = RecordingLoop(make_engine(tiny_model, budget=64), stream_interval_s=60.0)
    loop.text_tokens = text_tokens
    loop.start()
    try:
        assert _generate(loop, "r", prompt, 8) == expected
        assert loop.handovers == [[1], [1], [1] * 6]
        asyncio.run(loop.call(assert_no_leaks))
    finally:
        loop.stop()


def test_the_engine_holds_after_first_tokens_until_the_loop_took_them(tiny_model):
    # After the step that made a request's first token the engine thread waits for the event
    # loop to take it (the token goes out before the next step takes the cores). Here the loop is
    # blocked once the request is in: the engine makes the first token and must step no further
    # until the loop runs again. (On a loaded machine the engine may be slow to reach its first
    # step; the test then checks less, but never fails for it.)
    import time

    loop = EngineLoop(make_engine(tiny_model, budget=64))
    loop.first_token_handoff_s = 600.0
    loop.start()
    prompt = list(range(30, 44))
    try:
        async def main() -> list[int]:
            q = loop.open_stream("r")
            start = loop.engine.num_steps
            await loop.call(lambda e: e.add_request("r", params=greedy(6), prompt_token_ids=prompt))
            deadline = time.monotonic() + 120
            while loop.engine.num_steps == start and time.monotonic() < deadline:
                time.sleep(0.001)  # the event loop stays blocked: nothing is taken
            time.sleep(0.3)
            assert loop.engine.num_steps == start + 1, "the engine stepped on before the first token was taken"
            return [t async for out in loop.stream("r", q) for t in out.new_token_ids]

        assert asyncio.run(main()) == hf_greedy(tiny_model, [prompt], 6)[0]
    finally:
        loop.stop()
