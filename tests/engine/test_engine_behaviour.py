"""Engine behaviour beyond greedy parity: logprobs, seeds, n > 1, stops, aborts, admission."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.config import EngineConfig
from common.engine.llm_engine import LLMEngine, RequestError
from common.sampling.params import SamplingParams
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_logprobs, make_engine, random_prompts


@pytest.fixture(scope="module")
def llama(model_factory):
    return model_factory("llama")


def _vocab(engine) -> int:
    return engine.model_config.vocab_size


def test_logprobs_match_transformers(llama):
    engine = make_engine(llama, budget=32)
    prompts = random_prompts([5, 70], _vocab(engine), seed=3)
    outs = engine.generate(prompts, greedy(8, logprobs=5))
    for prompt, out in zip(prompts, outs):
        ref = hf_logprobs(llama, prompt, out[0].token_ids)  # [8, vocab]
        chosen = torch.tensor([lp for lp, _ in out[0].logprobs])
        assert torch.allclose(chosen, ref.gather(1, torch.tensor(out[0].token_ids)[:, None]).squeeze(1), atol=1e-4)
        for pos, (_, top) in enumerate(out[0].logprobs):
            vals, ids = ref[pos].topk(5)
            assert [t for t, _ in top] == ids.tolist()
            assert torch.allclose(torch.tensor([v for _, v in top]), vals, atol=1e-4)
    assert_no_leaks(engine)


def test_seeded_sampling_independent_of_batch(llama):
    engine = make_engine(llama)
    prompts = random_prompts([12, 30, 7, 50], _vocab(engine), seed=4)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    alone = engine.generate([prompts[0]], params)[0][0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=14, ignore_eos=True)
    mixed = engine.generate(prompts[1:3] + [prompts[0]] + prompts[3:], [others, others, params, others])
    assert mixed[2][0].token_ids == alone
    again = engine.generate([prompts[3], prompts[0]], [others, params])
    assert again[1][0].token_ids == alone
    assert_no_leaks(engine)


def test_n_choices_share_prompt_blocks(llama):
    engine = make_engine(llama, budget=64, prefix_caching=False)
    prompt = random_prompts([100], _vocab(engine), seed=5)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    engine.add_request("r", params=params, prompt_token_ids=prompt)
    # After the prompt is in, the siblings hold the same full blocks by reference.
    for _ in range(6):
        engine.step()
    tables = [engine.kv.block_table(f"r#{i}") for i in range(3) if engine.kv.has_request(f"r#{i}")]
    assert len(tables) == 3
    full = len(prompt) // 16
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.index] = out.token_ids
    assert sorted(finals) == [0, 1, 2]
    assert len({tuple(v) for v in finals.values()}) > 1, "siblings with different seeds should differ"
    assert_no_leaks(engine)


def test_greedy_n_identical(llama):
    engine = make_engine(llama)
    prompt = random_prompts([20], _vocab(engine), seed=6)[0]
    outs = engine.generate([prompt], greedy(6, n=2))[0]
    assert outs[0].token_ids == outs[1].token_ids
    assert_no_leaks(engine)


def test_abort_at_any_point_frees_blocks(llama):
    engine = make_engine(llama, budget=16)
    prompts = random_prompts([200, 40, 3], _vocab(engine), seed=8)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", params=greedy(50), prompt_token_ids=p)
    engine.step()  # a0 is mid-prefill, the others wait
    assert engine.abort_request("a0")
    assert engine.abort_request("a2")  # still waiting
    for _ in range(8):
        engine.step()  # a1 decoding
    assert engine.abort_request("a1")
    assert not engine.abort_request("a1")
    assert_no_leaks(engine)


def test_stop_strings_and_token_ids(llama):
    engine = make_engine(llama)
    prompt = random_prompts([10], _vocab(engine), seed=9)[0]
    free = engine.generate([prompt], greedy(20))[0][0]
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = engine.generate([prompt], greedy(20, stop_token_ids=[stop_tok]))[0][0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # A stop string taken from the middle of the free-running text.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = engine.generate([prompt], greedy(20, stop=[stop]))[0][0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.index(stop)]
    assert_no_leaks(engine)


def test_min_tokens_and_eos(llama):
    engine = make_engine(llama)
    eos = engine.eos_token_ids[0]
    prompt = random_prompts([10], _vocab(engine), seed=10)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[]))[0][0]
    assert len(out.token_ids) <= 5
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))[0][0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids
    assert_no_leaks(engine)


def test_admission_errors_name_the_field(llama):
    engine = make_engine(llama, num_blocks=8)
    with pytest.raises(RequestError) as e:
        engine.add_request("x", params=greedy(4), prompt_token_ids=[])
    assert e.value.field == "prompt"
    with pytest.raises(RequestError) as e:
        engine.add_request("x", params=greedy(4), prompt_token_ids=[10**9])
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(RequestError) as e:  # can never fit 8 blocks of 16 tokens
        engine.add_request("x", params=greedy(100), prompt_token_ids=list(range(10, 100)))
    assert e.value.field == "max_tokens"
    with pytest.raises(RequestError) as e:
        engine.add_request("x", params=greedy(10), prompt_token_ids=[11] * (engine.max_model_len + 1))
    assert e.value.field == "prompt"
    assert_no_leaks(engine)


def test_text_prompt_and_detokenized_output(llama):
    engine = make_engine(llama)
    out = engine.generate(["Hello world, café 東京"], greedy(10))[0][0]
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert_no_leaks(engine)


def test_an_engine_without_a_detokenizer_loads_one_tokenizer_for_all_its_users(llama):
    # Decode and prefill engines do not detokenize; grammars and first-text streaming load the
    # model's tokenizer once, shared, and text prompts stay refused by name.
    engine = LLMEngine(EngineConfig(model=str(llama), dtype="float32", device="cpu"), detokenize=False)
    assert engine.tokenizer is None
    tokenizer = engine.vocab_tokenizer()
    assert engine.vocab_tokenizer() is tokenizer
    with pytest.raises(RequestError) as info:
        engine.tokenize("Hello")
    assert info.value.field == "prompt"
    detokenizing = make_engine(llama)
    assert detokenizing.vocab_tokenizer() is detokenizing.tokenizer


def _run_resumed(engine, prompt: list[int], params: SamplingParams, num_resumed: int) -> list[int]:
    engine.add_request("resumed", params=params, prompt_token_ids=prompt, num_resumed_outputs=num_resumed)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.token_ids)
    return tokens


@pytest.mark.parametrize("params", [
    greedy(12, presence_penalty=0.8, frequency_penalty=0.5),
    SamplingParams(temperature=1.0, seed=77, max_tokens=12, min_tokens=9, presence_penalty=0.7,
                   frequency_penalty=0.4, repetition_penalty=1.2),
], ids=["greedy-penalties", "seeded-penalties-min-tokens"])  # fmt: skip
def test_a_resumed_request_continues_as_the_uninterrupted_one(llama, params):
    """Migration: prompt + the first K outputs, K marked as resumed, with what is left of
    max_tokens/min_tokens, gives exactly the uninterrupted request's remaining tokens."""
    engine = make_engine(llama)
    prompt = random_prompts([21], _vocab(engine), seed=12)[0]
    whole = engine.generate([prompt], params)[0][0].token_ids
    assert len(whole) == 12
    for k in (1, 5, 10):
        rest = dataclasses.replace(params, max_tokens=12 - k, min_tokens=max(0, params.min_tokens - k))
        assert _run_resumed(engine, prompt + whole[:k], rest, k) == whole[k:], k
    assert_no_leaks(engine)
    with pytest.raises(RequestError, match="num_resumed_outputs"):
        engine.add_request("bad", params=greedy(4), prompt_token_ids=prompt, num_resumed_outputs=len(prompt))
