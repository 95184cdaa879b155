"""Prompt logprobs and logit_bias in the engine, checked against transformers on the same weights."""

from __future__ import annotations

import math

import pytest
import torch

from common.sampling.params import SamplingParams
from tests.engine.engine_helpers import _hf_model, assert_no_leaks, greedy, make_engine, random_prompts


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at prompt positions 0 .. P-2: [P-1, vocab]."""
    with torch.no_grad():
        logits = _hf_model(str(model))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


@pytest.mark.parametrize("budget", [2048, 24])  # one step, or prompt chunks of 24 tokens
def test_prompt_logprobs_equal_transformers(tiny_model, budget):
    engine = make_engine(tiny_model, budget=budget)
    vocab = engine.model_config.vocab_size
    prompts = random_prompts([1, 17, 70], vocab, seed=3)
    for prompt in prompts:
        engine.add_request("r", params=greedy(2, prompt_logprobs=3), prompt_token_ids=prompt)
        outs = _drain(engine)
        first = outs[0]  # the output that starts the choice carries them; later ones do not
        assert all(o.prompt_logprobs is None for o in outs[1:]) and first.prompt_logprobs is not None
        assert len(first.prompt_logprobs) == len(prompt) - 1
        if len(prompt) == 1:
            continue
        ref = hf_prompt_logprobs(tiny_model, prompt)
        for pos, (token, logprob, top) in enumerate(first.prompt_logprobs):
            assert token == prompt[pos + 1]
            assert math.isclose(logprob, ref[pos, token].item(), abs_tol=1e-4)
            ref_top = ref[pos].topk(3)
            assert [t for t, _ in top] == ref_top.indices.tolist()
            assert all(math.isclose(lp, r, abs_tol=1e-4) for (_, lp), r in zip(top, ref_top.values.tolist()))
    assert_no_leaks(engine)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_model):
    """A prompt whose blocks are cached still gets every position's logprob."""
    engine = make_engine(tiny_model)
    prompt = random_prompts([50], engine.model_config.vocab_size, seed=5)[0]
    engine.generate([prompt], greedy(1))  # now 3 full blocks are cached
    engine.add_request("again", params=greedy(1, prompt_logprobs=0), prompt_token_ids=prompt)
    firsts = [o for o in _drain(engine) if o.prompt_logprobs is not None]
    assert len(firsts) == 1 and len(firsts[0].prompt_logprobs) == len(prompt) - 1
    assert all(top == [] for _, _, top in firsts[0].prompt_logprobs)
    ref = hf_prompt_logprobs(tiny_model, prompt)
    assert math.isclose(firsts[0].prompt_logprobs[10][1], ref[10, prompt[11]].item(), abs_tol=1e-4)
    assert_no_leaks(engine)


def test_prompt_logprobs_with_n_come_once(tiny_model):
    engine = make_engine(tiny_model)
    prompt = random_prompts([20], engine.model_config.vocab_size, seed=6)[0]
    engine.add_request("n3", params=SamplingParams(n=3, max_tokens=2, seed=1, prompt_logprobs=1),
                       prompt_token_ids=prompt)  # fmt: skip
    with_prompt = [o for o in _drain(engine) if o.prompt_logprobs is not None]
    assert [o.index for o in with_prompt] == [0] and len(with_prompt[0].prompt_logprobs) == 19
    assert_no_leaks(engine)


def _drain(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_logit_bias_forces_and_bans_tokens(tiny_model):
    engine = make_engine(tiny_model)
    vocab = engine.model_config.vocab_size
    prompt = random_prompts([12], vocab, seed=7)[0]
    (plain,), = engine.generate([prompt], [greedy(4)])
    forced = 123 if plain.token_ids[0] != 123 else 124
    (out,), = engine.generate([prompt], [greedy(4, logit_bias={str(forced): 100})])
    assert out.token_ids == [forced] * 4
    (out,), = engine.generate([prompt], [SamplingParams(max_tokens=8, seed=3, ignore_eos=True,
                                                      logit_bias={plain.token_ids[0]: -100})])  # fmt: skip
    assert plain.token_ids[0] not in out.token_ids
    with pytest.raises(Exception, match="logit_bias"):
        engine.add_request("bad", params=greedy(1, logit_bias={vocab: 1}), prompt_token_ids=prompt)
    assert_no_leaks(engine)


def test_prompt_logprobs_survive_preemption(tiny_model):
    """A small pool and budget: requests are preempted (some mid-prompt) and recomputed; each
    prompt's logprobs are still reported once, complete, and equal to transformers'."""
    engine = make_engine(tiny_model, budget=32, num_blocks=14)
    vocab = engine.model_config.vocab_size
    prompts = random_prompts([60, 45, 70, 30], vocab, seed=11)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", params=greedy(24, prompt_logprobs=0), prompt_token_ids=p)
    got = {}
    for out in _drain(engine):
        if out.prompt_logprobs is not None:
            assert out.request_id not in got
            got[out.request_id] = out.prompt_logprobs
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        ref = hf_prompt_logprobs(tiny_model, p)
        assert [t for t, _, _ in got[f"p{i}"]] == p[1:]
        assert all(math.isclose(lp, ref[pos, t].item(), abs_tol=1e-4) for pos, (t, lp, _) in enumerate(got[f"p{i}"]))
    assert_no_leaks(engine)


def test_logit_bias_with_speculation(tiny_model):
    """Verification scores drafts with the same biased distribution: forced tokens stay forced."""
    from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from common.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=str(tiny_model), dtype="float32", device="cpu", cache=CacheConfig(block_size=16, num_kv_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=512), speculative=SpeculativeConfig(
            method="ngram", num_speculative_tokens=3, adaptive=False)))  # fmt: skip
    prompt = [5, 6, 7, 321, 321, 321, 321, 8, 321, 321]
    (out,), = engine.generate([prompt], [greedy(12, logit_bias={321: 100})])
    assert out.token_ids == [321] * 12
    assert engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(engine)
