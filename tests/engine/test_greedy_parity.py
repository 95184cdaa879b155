"""Greedy outputs equal transformers generate(), token for token, whatever the batching."""

from __future__ import annotations

import pytest

from tests.conftest import ARCHS
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_greedy, make_engine, random_prompts

LENGTHS = [1, 3, 17, 40, 64, 100, 150, 210]  # one token up to several 64-token chunks
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(model_factory):
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = model_factory(arch)
            from common.models.config import ModelConfig

            vocab = ModelConfig.from_pretrained(path).vocab_size
            prompts = random_prompts(LENGTHS, vocab, seed=1)
            cache[arch] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [7, 64, 4096])
def test_batch_matches_transformers(references, arch, budget):
    path, prompts, expected = references(arch)
    engine = make_engine(path, budget=budget)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert all(o[0].finish_reason == "length" for o in outs)
    assert_no_leaks(engine)


def test_references_are_varied(references):
    # Parity means little if the model repeats one token; make-model must give varied outputs.
    _, _, expected = references("llama")
    assert all(len(set(seq)) >= 4 for seq in expected), expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_cache_second_wave(references, arch):
    path, prompts, expected = references(arch)
    engine = make_engine(path, budget=64)
    first = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in first] == expected
    # Same prompts again: every full block of each prompt is already cached.
    second = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in second] == expected
    for p, o in zip(prompts, second):
        assert o[0].num_cached_tokens == ((len(p) - 1) // 16) * 16
    assert engine.kv.prefix_cache_hits > 0
    assert_no_leaks(engine)


def test_shared_prefix_different_suffix(references):
    path, prompts, _ = references("llama")
    base = prompts[-1][:160]
    variants = [base + [9, 10, 11], base + [12], base + [13, 14, 15, 16, 17]]
    expected = hf_greedy(path, variants, MAX_TOKENS)
    engine = make_engine(path, budget=64)
    engine.generate([base], greedy(1))
    outs = engine.generate(variants, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert all(o[0].num_cached_tokens == 160 for o in outs)
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["llama", "granite"])
def test_forced_preemption(references, arch):
    path, prompts, expected = references(arch)
    # 20 blocks of 16 tokens: the longest request (210 + 12 tokens) fits alone, the batch does not.
    engine = make_engine(path, budget=64, num_blocks=20)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_no_prefix_caching(references):
    path, prompts, expected = references("qwen2")
    engine = make_engine(path, budget=64, prefix_caching=False)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    outs2 = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected == [o[0].token_ids for o in outs2]
    assert all(o[0].num_cached_tokens == 0 for o in outs2)
    assert_no_leaks(engine)
