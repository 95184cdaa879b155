"""A step larger than the model's pass limit runs as consecutive passes with the same logits."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from common.engine.model_runner import ModelRunner, SequenceInput, split_passes
from common.kernels import cpu_decoder
from common.models.loader import load_model


def _batch() -> list[SequenceInput]:
    return [
        SequenceInput(list(range(100, 137)), 0, [0], 1),  # a prompt chunk that samples
        SequenceInput([5], 20, [1], 1),  # a decode token
        SequenceInput(list(range(200, 223)), 4, [2], 0),  # mid-prompt: no logits
        SequenceInput([7, 8, 9, 10], 30, [3], 4),  # a verification span
    ]


@pytest.mark.parametrize("limit", [1, 3, 16, 37, 38, 64, 1000])
def test_split_passes_keeps_every_token_in_order_and_the_logit_rows(limit):
    batch = _batch()
    passes = split_passes(batch, limit)
    assert all(0 < sum(len(s.token_ids) for s in p) <= limit for p in passes)
    pieces = [s for p in passes for s in p]
    for original in batch:
        mine = [s for s in pieces if s.block_table is original.block_table]
        assert [t for s in mine for t in s.token_ids] == original.token_ids
        assert [s.start_pos for s in mine] == [original.start_pos + sum(len(m.token_ids) for m in mine[:i])
                                               for i in range(len(mine))]  # fmt: skip
        assert sum(s.num_logits for s in mine) == original.num_logits
        # The logits stay on the sequence's trailing positions: only its last pieces carry them.
        rows = [s.start_pos + j for s in mine for j in range(len(s.token_ids) - s.num_logits, len(s.token_ids))]
        end = original.start_pos + len(original.token_ids)
        assert rows == list(range(end - original.num_logits, end))
    # Sequences keep their order, so the passes' logits concatenated are the batch's.
    order = [next(i for i, o in enumerate(batch) if o.block_table is s.block_table) for s in pieces]
    assert order == sorted(order)
    if limit >= sum(len(s.token_ids) for s in batch):
        assert len(passes) == 1


def _runner(model, cfg, num_blocks: int = 64, block_size: int = 16) -> ModelRunner:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    return ModelRunner(model, caches, block_size, torch.device("cpu"))


@pytest.mark.parametrize("every_thread", (False, True))
def test_float32_weights_of_small_layers_split_only_where_they_take_every_thread(model_factory, monkeypatch,
                                                                                 every_thread):  # fmt: skip
    # Layers that run on one thread keep one pass (the tiny model: 4 x 128 prompt tokens 13.3 ms as
    # fused passes vs 10.5 ms in one PyTorch pass on the AMD EPYC that splits); where the build runs
    # small layers on every thread too (cpu_decoder.PARALLEL_SMALL_LAYERS: an Intel Xeon, fused passes
    # 1.79x faster quiet) they split as large layers do, on the builds that split.
    monkeypatch.setattr(cpu_decoder, "_parallel_small_layers", lambda: every_thread)
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    assert cfg.layer_weights < cpu_decoder.MIN_PARALLEL_LAYER_FLOATS
    variant = cpu_decoder._variant()
    splits = (every_thread and cpu_decoder.available() and not cpu_decoder.native.avx2_on_avx512(variant)
              and cpu_decoder.native.tuned(cpu_decoder.SPLITS_FLOAT32_STEPS, variant, False))  # fmt: skip
    assert (_runner(model, cfg).max_pass_tokens is not None) == bool(splits)


@pytest.mark.skipif(not cpu_decoder.available(), reason="fused CPU decoder unavailable here")
def test_float32_weights_split_exactly_on_the_builds_that_gain(model_factory, monkeypatch):
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)  # as if its layers were large
    variant = cpu_decoder._kernel.variant
    listed = cpu_decoder.native.tuned(cpu_decoder.SPLITS_FLOAT32_STEPS, variant, False)
    limits = _runner(model, cfg).max_pass_tokens
    assert (limits is not None) == bool(listed and not cpu_decoder.native.avx2_on_avx512(variant))


@pytest.mark.skipif(not cpu_decoder.available(), reason="fused CPU decoder unavailable here")
@pytest.mark.parametrize("arch", ("llama", "qwen2"))
@pytest.mark.parametrize("weights", ("bfloat16", "float32"))
def test_a_long_step_runs_as_fused_passes_with_the_same_logits(model_factory, arch, weights, monkeypatch):
    # bf16-stored weights: past the fused decoder's crossover PyTorch's path would widen every
    # matrix per pass; float32 weights on a build that SPLITS_FLOAT32_STEPS (forced here on any
    # build, the layers counted as large): the fused passes beat one PyTorch pass. Either way the
    # runner cuts the step into fused passes, with the same logits and KV as one pass through
    # PyTorch's layers.
    if weights == "float32":
        monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)
        monkeypatch.setattr(cpu_decoder, "SPLITS_FLOAT32_STEPS", dict.fromkeys(cpu_decoder.native.VARIANTS, True))
    model, cfg = load_model(model_factory(arch), dtype="float32", weight_dtype=weights if weights == "bfloat16" else None)
    reference = copy.deepcopy(model)
    reference.use_fused_cpu = False
    runner, plain = _runner(model, cfg), _runner(reference, cfg)
    assert runner.max_pass_tokens == (cpu_decoder.max_tokens(False), cpu_decoder.max_tokens(True))
    assert plain.max_pass_tokens is None
    limit = runner.max_pass_tokens[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(8, cfg.vocab_size) for _ in range(n)] for n in (limit + 5, 3, limit // 2 + 1)]
    blocks = iter(range(64))
    batch = [SequenceInput(p, 0, [next(blocks) for _ in range(-(-len(p) // 16))], n_logits)
             for p, n_logits in zip(prompts, (2, 1, 0))]  # fmt: skip
    sizes = []
    real = cpu_decoder.FusedDecoder.forward

    def counting(self, x, positions, meta):
        sizes.append(x.shape[0])
        return real(self, x, positions, meta)

    monkeypatch.setattr(cpu_decoder.FusedDecoder, "forward", counting)
    got = runner.execute(batch)
    want = plain.execute(batch)
    assert sum(sizes) == sum(len(p) for p in prompts) and len(sizes) > 1 and max(sizes) <= limit
    assert got.shape == want.shape == (3, cfg.vocab_size)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    for (kg, vg), (kw, vw) in zip(runner.kv_caches, plain.kv_caches):
        torch.testing.assert_close(kg, kw, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vg, vw, atol=1e-4, rtol=1e-4)
