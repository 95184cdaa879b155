"""The fused native CPU decoder computes what the PyTorch layers compute, KV cache writes included."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import shutil
import weakref

import pytest
import torch
from safetensors.torch import save_file

from common.kernels import cpu_decoder, native
from common.kernels.cpu_decoder import FusedDecoder
from common.models.config import ModelConfig
from common.models.loader import load_model
from common.models.make_model import random_weights
from tests.engine.engine_helpers import round_matrices_to_bf16
from tests.models.paged_helpers import PagedRunner

pytestmark = pytest.mark.skipif(not cpu_decoder.available(), reason="fused CPU decoder unavailable here")

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite")


def _steps() -> list[dict[int, list[int]]]:
    # A chunked prompt, then decode steps that mix a second sequence's prompt, then verification-
    # sized spans (k + 1 tokens) next to single decode tokens; spans straddle block edges.
    return [
        {0: list(range(3, 40))},
        {0: [41], 1: list(range(50, 61))},
        {0: list(range(62, 81)), 1: list(range(90, 110)), 2: list(range(3, 24))},  # 60 tokens: 4 vectors, the last short
        {0: [7, 8, 9, 10, 11], 1: [12]},
        {0: [13], 1: [14, 15, 16]},
        {1: [17]},
    ]


@contextlib.contextmanager
def _torch_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _compare_steps(fused: PagedRunner, plain: PagedRunner, steps: list[dict[int, list[int]]], threads: int) -> None:
    """Runs each step through both runners on `threads` threads: their logits must agree."""
    with _torch_threads(threads):
        for chunks in steps:
            got, want = fused.step(chunks), plain.step(chunks)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("wide", [False, True], ids=["dot-tiles", "wide"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_matches_pytorch_layers(model_factory, kernel_variant, arch, threads, wide, monkeypatch):
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)  # the test models are tiny: split them too
    # Every step wide (transposed inputs; single tokens and partial vectors too), or none.
    monkeypatch.setattr(cpu_decoder, "WIDE_MIN_TOKENS", 1 if wide else 10**9)
    model, cfg = load_model(model_factory(arch), dtype="float32")
    reference = copy.deepcopy(model)
    reference.use_fused_cpu = False
    fused, plain = PagedRunner(model, cfg, seed=3), PagedRunner(reference, cfg, seed=3)
    _compare_steps(fused, plain, _steps(), threads)
    assert model._fused is not None and reference._fused is None  # each took the path it was meant to
    assert cpu_decoder._kernel.variant == kernel_variant
    for (kf, vf), (kp, vp) in zip(fused.kv_caches, plain.kv_caches):
        torch.testing.assert_close(kf, kp, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(vf, vp, atol=1e-4, rtol=1e-4)


def test_results_do_not_depend_on_how_many_threads_share_the_phases(model_factory, monkeypatch):
    """Each thread takes its own segment of a phase's chunks first, then what is left of the others':
    1, 2, 3 and 5 threads (more than this machine's cores, so threads lose theirs mid-phase and the
    others take over their segments) must give the same logits and caches, bit for bit."""
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)  # the test model is tiny: split it too
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    results = []
    for threads in (1, 2, 3, 5):
        runner = PagedRunner(copy.deepcopy(model), cfg, seed=3)
        with _torch_threads(threads):
            logits = [runner.step(chunks) for chunks in _steps()]
        assert runner.model._fused is not None
        results.append((logits, runner.kv_caches))
    for logits, caches in results[1:]:
        for got, want in zip(logits, results[0][0]):
            for g, w in zip(got, want):
                assert torch.equal(g, w)
        for (k, v), (k0, v0) in zip(caches, results[0][1]):
            assert torch.equal(k, k0) and torch.equal(v, v0)


def test_decode_steps_of_many_sequences_attend_every_kv_head_at_once_with_the_same_results(model_factory,
                                                                                         monkeypatch):
    """A decode step of >= 4 tokens a thread takes each token with all its KV heads as one attention
    item (a cache slot read whole); fewer take a (token, KV head) an item. 12 decoding sequences on
    1 thread (whole slots) and on 4 (per KV head) must agree bit for bit, and with PyTorch's layers."""
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    assert cfg.num_kv_heads > 1
    prompts = {s: list(range(3 + s, 3 + s + 17 + 5 * s)) for s in range(12)}  # 17-72 tokens: over block edges
    decodes = [{s: [100 + 7 * k + s] for s in range(12)} for k in range(3)]
    reference = copy.deepcopy(model)
    reference.use_fused_cpu = False
    plain = PagedRunner(reference, cfg, num_blocks=256, seed=5)
    runs = {}
    for threads in (1, 4):
        runner = PagedRunner(copy.deepcopy(model), cfg, num_blocks=256, seed=5)
        with _torch_threads(threads):
            runner.step(prompts)
            runs[threads] = [runner.step(chunks) for chunks in decodes]
    plain.step(prompts)
    for k, chunks in enumerate(decodes):
        want = plain.step(chunks)
        for a, b, w in zip(runs[1][k], runs[4][k], want):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, w, atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="session")
def shaped_llama(model_factory, tmp_path_factory):
    """shaped_llama(heads, kv_heads, head_dim) -> a tiny Llama folder with those attention shapes."""
    made = {}

    def make(heads: int, kv_heads: int, head_dim: int):
        if (heads, kv_heads, head_dim) not in made:
            out = tmp_path_factory.mktemp(f"llama-{heads}x{kv_heads}x{head_dim}")
            shutil.copytree(model_factory("llama"), out, dirs_exist_ok=True)
            raw = json.loads((out / "config.json").read_text())
            raw.update(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
            (out / "config.json").write_text(json.dumps(raw))
            weights = random_weights(ModelConfig.from_pretrained(out), seed=2)
            save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
            made[heads, kv_heads, head_dim] = out
        return made[heads, kv_heads, head_dim]

    return make


def _prompt_steps() -> list[dict[int, list[int]]]:
    # Prompt chunks of 9+ tokens take the query-block attention (blocks of 16 tokens on AVX-512, 8
    # on AVX2, the last ending the chunk): lengths that are no multiple of either, so the first
    # block is short (1-13 tokens: those under 4 go token by token), chunks that start mid-sequence
    # (context already cached), and neighbours on the per-token path (decode tokens, 6-token spans).
    return [
        {0: list(range(3, 48))},  # 45 tokens from position 0
        {0: list(range(50, 73)), 1: list(range(100, 110))},  # 23 more mid-sequence; a 10-token prompt
        {0: [11], 1: list(range(120, 139)), 2: list(range(200, 206)), 3: list(range(300, 333))},
        {0: list(range(400, 417)), 1: [12], 3: list(range(340, 349))},  # 17 and 9 tokens mid-sequence
        {0: [13], 1: [14], 2: [15], 3: [16]},
    ]


# (query heads, KV heads, head_dim): groups of 1, 2, 3, 4 and 8 query heads per KV head, head_dim 16-128
ATTENTION_SHAPES = [(4, 4, 32), (4, 2, 32), (6, 2, 64), (6, 2, 32), (4, 1, 64), (8, 1, 16), (2, 1, 128)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prompt_chunks_attend_as_pytorch_does(shaped_llama, kernel_variant, shape, block_size, monkeypatch):
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)  # both threads share each phase
    monkeypatch.setattr(cpu_decoder, "MAX_TOKENS_AVX2_ON_AVX512", (cpu_decoder.MAX_TOKENS,) * 2)  # AVX2 too
    fused_steps = []
    forward = FusedDecoder.forward
    monkeypatch.setattr(FusedDecoder, "forward", lambda self, *a: fused_steps.append(1) or forward(self, *a))
    model, cfg = load_model(shaped_llama(*shape), dtype="float32")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == shape
    reference = copy.deepcopy(model)
    reference.use_fused_cpu = False
    fused = PagedRunner(model, cfg, num_blocks=128, block_size=block_size, seed=4)
    plain = PagedRunner(reference, cfg, num_blocks=128, block_size=block_size, seed=4)
    _compare_steps(fused, plain, _prompt_steps(), threads=2)
    assert len(fused_steps) == len(_prompt_steps())  # every step took the native path
    assert cpu_decoder._kernel.variant == kernel_variant


@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_saturated_softmax_and_silu_match(model_factory, kernel_variant, arch, monkeypatch):
    # Large weights push SiLU's inputs and the attention logits far past exp's float32 range, where
    # the kernel's vector exp clamps its inputs: the outputs must still be PyTorch's. (llama: the
    # grouped attention; qwen3's head_dim 48: the per-head one.)
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)
    model, cfg = load_model(model_factory(arch), dtype="float32")
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate_up_proj.weight.mul_(400.0)
            layer.attn.qkv_proj.weight.mul_(40.0)
    reference = copy.deepcopy(model)
    reference.use_fused_cpu = False
    fused, plain = PagedRunner(model, cfg, seed=5), PagedRunner(reference, cfg, seed=5)
    for chunks in _steps():
        got, want = fused.step(chunks), plain.step(chunks)
        for g, w in zip(got, want):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)
    assert model._fused is not None


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("arch", ("llama", "qwen2", "granite"))
def test_bf16_weights_compute_what_their_float32_values_do(model_factory, kernel_variant, arch, fused, monkeypatch):
    # weight_dtype="bfloat16": matrices stored in bf16, the math, norms, biases and KV cache in
    # float32, through the fused decoder and through the PyTorch layers (prompt chunks too long
    # for the fused path, or no fused path at all).
    monkeypatch.setattr(cpu_decoder, "MIN_PARALLEL_LAYER_FLOATS", 0)
    model, cfg = load_model(model_factory(arch), dtype="float32", weight_dtype="bfloat16")
    assert model.dtype == torch.float32 and model.weight_dtype == torch.bfloat16
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert model.layers[0].input_norm.weight.dtype == torch.float32
    model.use_fused_cpu = fused
    reference, _ = load_model(model_factory(arch), dtype="float32")
    round_matrices_to_bf16(reference)
    reference.use_fused_cpu = False
    got_runner, want_runner = PagedRunner(model, cfg, seed=3), PagedRunner(reference, cfg, seed=3)
    assert got_runner.kv_caches[0][0].dtype == torch.float32
    for chunks in _steps():
        got, want = got_runner.step(chunks), want_runner.step(chunks)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4)
    assert (model._fused is not None) == fused


def test_fused_view_keeps_the_caches_it_points_at(model_factory):
    # The native view stores every layer's cache address; while it is the model's, none of those
    # caches may be freed (and its memory handed to the next runner's caches behind its back).
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    runner = PagedRunner(model, cfg)
    runner.step({0: [1, 2, 3]})
    middle = weakref.ref(runner.kv_caches[len(runner.kv_caches) // 2][0])
    del runner
    gc.collect()
    assert middle() is not None
    fresh = PagedRunner(model, cfg, seed=5)  # new caches: a new view, the old caches let go
    fresh.step({0: [1, 2, 3]})
    gc.collect()
    assert middle() is None and model._fused.key == FusedDecoder.key_of(model, fresh.kv_caches)


def test_large_batches_and_other_dtypes_keep_pytorch(model_factory, kernel_variant):
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    runner = PagedRunner(model, cfg, num_blocks=320, block_size=4)
    prompt_limit, short_limit = cpu_decoder.max_tokens(False), cpu_decoder.max_tokens(True)  # this build's crossovers
    forced = cpu_decoder.native.avx2_on_avx512(kernel_variant)
    assert (prompt_limit, short_limit) == (
        cpu_decoder.MAX_TOKENS_AVX2_ON_AVX512 if forced
        else cpu_decoder.native.tuned(cpu_decoder.MAX_TOKENS_BY_BUILD, kernel_variant, (0, 0)))
    runner.step({0: list(range(prompt_limit + 1))})  # a long prompt chunk: PyTorch's GEMMs
    assert model._fused is None
    runner.step({1: list(range(prompt_limit))})  # as many prompt tokens as the build takes: fused
    assert model._fused is not None
    model._fused = None
    short = cpu_decoder.SHORT_QUERY
    assert short_limit % short == 0
    many = {10 + s: [s] * short for s in range(short_limit // short)}  # verification-like: short queries
    runner.step(many)  # short_limit tokens
    assert model._fused is not None
    model._fused = None
    runner.step({**many, 99: [1]})  # one token more: PyTorch's layers
    assert model._fused is None
    half, half_cfg = load_model(model_factory("llama"), dtype="bfloat16")
    PagedRunner(half, half_cfg).step({0: [1, 2, 3]})
    assert half._fused is None


def test_cached_and_streamed_weights_give_the_same_bits(model_factory, monkeypatch):
    """Layers that fit in cache run their 1-, 2- and 4-row steps on the tiles where
    native.tiles_in_cache() (AMD without AVX-512), streamed ones (on AMD) one weight row at a time
    (gemm_tiles.h, rows_in_turn_for): a speed choice only, so both must give the same logits and
    caches bit for bit, whichever CPU runs the test."""
    monkeypatch.setattr(native, "tiles_in_cache", lambda: True)
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    steps = [{0: list(range(3, 20))}, {0: [21]}, {0: [22], 1: list(range(30, 41))}, {0: [23], 1: [42]},
             {0: [24], 1: [43], 2: list(range(50, 55))}, {0: [25], 1: [44], 2: [56], 3: list(range(60, 66))},
             {0: [26], 1: [45], 2: [57], 3: [67]}]  # fmt: skip
    runs = []
    for cached in (True, False):
        monkeypatch.setattr(cpu_decoder, "CACHED_WEIGHT_BYTES", 1 << 40 if cached else 0)
        runner = PagedRunner(copy.deepcopy(model), cfg, seed=3)
        runs.append(([runner.step(chunks) for chunks in steps], runner))
        assert runner.model._fused.desc.weights_cached == int(cached)
    (cached_logits, cached_runner), (streamed_logits, streamed_runner) = runs
    for got, want in zip(cached_logits, streamed_logits):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    for (k, v), (k0, v0) in zip(cached_runner.kv_caches, streamed_runner.kv_caches):
        assert torch.equal(k, k0) and torch.equal(v, v0)


@pytest.mark.parametrize("every_thread,decode_from", ((False, 1), (True, 1), (True, 2)))
def test_small_layers_take_every_thread_only_where_the_build_says(model_factory, monkeypatch, every_thread,
                                                                  decode_from):
    # A model under MIN_PARALLEL_LAYER_FLOATS steps on one thread, except a prompt alone in its step,
    # and except on builds listed in PARALLEL_SMALL_LAYERS (AVX-512, Intel and AMD: its prompts gain
    # a second thread there), where its wide steps take every thread, and its narrow (decode) steps
    # from PARALLEL_SMALL_DECODE_MIN_TOKENS tokens (Intel 1; AMD 2: a one-row step keeps one thread).
    monkeypatch.setattr(cpu_decoder, "_parallel_small_layers", lambda: every_thread)
    monkeypatch.setattr(cpu_decoder, "_parallel_small_decode_min_tokens", lambda: decode_from)
    asked = []
    real_get = cpu_decoder._kernel.get

    def get(*args):
        fn = real_get(*args)
        return (lambda *a: asked.append(a[-1]) or fn(*a)) if fn else fn

    monkeypatch.setattr(cpu_decoder._kernel, "get", get)
    model, cfg = load_model(model_factory("llama"), dtype="float32")
    assert cfg.layer_weights < cpu_decoder.MIN_PARALLEL_LAYER_FLOATS
    runner = PagedRunner(model, cfg, num_blocks=64, block_size=16, seed=0)
    with _torch_threads(2):
        runner.step({0: list(range(3, 40))})  # one prompt of 37 tokens alone: every thread
        runner.step({0: [41]})  # one decode row
        runner.step({0: [42], 1: list(range(50, 55))})  # a decode token beside a short prompt: narrow
        runner.step({0: [43], 1: [60], 2: list(range(70, 110))})  # two decode tokens beside a prompt: wide
    assert cpu_decoder.WIDE_MIN_TOKENS <= 42
    assert asked == [2, 2 if every_thread and decode_from == 1 else 1, 2 if every_thread else 1,
                     2 if every_thread else 1]
