"""The fused CPU decoder (cpu_decoder.cpp): every layer of a DecoderModel in one native call.

Taken by DecoderModel.forward for small float32 CPU batches (decode steps, verification passes,
short prefill chunks: up to max_tokens() tokens for the loaded build) with the torch attention
backend; the weights are float32, or bfloat16 (weight_dtype="bfloat16": widened as they load,
float32 math). It computes what the PyTorch layers compute, reading the paged KV cache in place, and costs one call per step
instead of ~60 PyTorch dispatches per layer. Larger batches stay on the PyTorch path, where MKL's
GEMMs and SDPA are faster. TANDEM_CPU_GEMM picks the build or turns it off, as for the small GEMM.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from common.attention.metadata import AttentionMetadata
from common.kernels import native

if TYPE_CHECKING:
    from common.models.decoder import DecoderModel

# Tokens per step up to which the fused path beats PyTorch's layers (benchmarks/cpu_kernel_steps.py,
# SmolLM2-135M, 2 threads), as (any batch, a batch of short queries: every sequence adds at most
# SHORT_QUERY tokens, as decode steps and verification passes do). One call instead of ~60
# dispatches per layer keeps the fused path ahead of MKL past the GEMM's own crossover
# (small_gemm.max_rows()), furthest where attention is per-sequence work; a prompt chunk (one long
# query) is where MKL's GEMMs and SDPA catch up first.
SHORT_QUERY = 8
MAX_TOKENS_BY_BUILD = {  # by build, or "build/vendor" where the vendor moves the crossover (native.tuned)
    # Intel Xeon, 2026-12-01: 16-96 decoding sequences 1.03-1.55x PyTorch's path (128: 0.98-1.07x);
    # verification passes of 8-16 sequences x 3-5 tokens 1.05-1.30x (forward only, paired medians).
    # Prompt chunks since the wide steps (2026-12-05, the engine's prompt step, 2 threads): SmolLM2
    # 128 tokens 163-183 ms vs 193, 192 even (237 vs 239), 256 even to 0.97x, 512 0.81x; the tiny
    # model 128 tokens 3.1 vs 5.3 ms, 256 6.7 vs 8.9, 512 even. (Before them: 32 tokens.)
    "avx512": (192, 96),
    # AMD EPYC with AVX-512 (Zen 4 class), since the wide steps (2026-12-06, forward only, 2 threads,
    # benchmarks/results/cpu_kernel_steps_epyc_wide*.json): a prompt chunk of SmolLM2-135M 1.40x
    # PyTorch's path at 128 tokens, 1.38x at 160, 1.08x at 192, 1.23x at 256 (tiny model 1.21x,
    # 1.16x, 1.04x, 1.62x); 64-256 decoding sequences 1.50-1.72x (tiny 1.08-1.17x). MKL takes its
    # slower paths on this CPU. (Before them, 2026-12-02: 128 tokens, 0.71x at 192.)
    "avx512/amd": (256, 256),
    # AMD EPYC without AVX-512 (Zen 2), since the AVX2 build's wide steps (2026-12-07, forward only, 2
    # threads, results cpu_kernel_steps_zen2_wide): a SmolLM2-135M prompt chunk 1.66x PyTorch's path
    # at 128 tokens, 1.43x at 192, 1.39x at 256; 64-256 decoding sequences 1.79-2.8x.
    "avx2/amd": (256, 256),
    "avx2": (64, 64),  # another CPU without AVX-512 (the dot-product tiles' crossover on a Zen 3 EPYC)
}
# TANDEM_CPU_GEMM=avx2 on that Xeon: prompt chunk 1.27x at 16 tokens, 0.93x at 24; decoding
# sequences 1.02x at 32, 0.83x at 48.
MAX_TOKENS_AVX2_ON_AVX512 = (16, 32)
MAX_TOKENS = max(max(limits) for limits in MAX_TOKENS_BY_BUILD.values())  # no build takes more tokens


def _variant() -> str:
    """The build this process loaded ("avx512", "avx2", or "" for none)."""
    _kernel.get()  # decides the build
    return _kernel.variant


def max_tokens(short_queries: bool) -> int:
    """Tokens up to which the process's build takes a step (0 when there is none)."""
    variant = _variant()
    limits = MAX_TOKENS_AVX2_ON_AVX512 if native.avx2_on_avx512(variant) else native.tuned(MAX_TOKENS_BY_BUILD, variant, (0, 0))
    return limits[short_queries]


# From this many tokens a step's linear layers read their inputs transposed (both builds;
# cpu_decoder.cpp, gemm_tiles.h's gemm_range_wide): no sum across a vector's lanes per output, a
# cost that weighs more the shorter the rows (the hidden size). Decode steps, forward alone, 2
# threads, wide / dot-product tiles (Intel Xeon, 2026-12-05): SmolLM2-135M (hidden 576) 1.19x at
# 12 sequences, 1.09x at 16, 1.01x at 24, 0.94x at 32, 0.88x at 96; the tiny model (hidden 128)
# 0.98x at 12, 0.86x at 16, 0.71x at 96. Yet the threshold is the same for every model, past the
# dot-product tiles' old 32-token reach: a step's numerics depend on its path, so a step the fused
# decoder took before the wide steps keeps its results bit for bit, and a request's results change
# with its neighbours only where they changed before (at 16 tokens on small models, two short
# prompts stepped together rounded differently from each alone: a gRPC / REST logprob test saw it).
WIDE_MIN_TOKENS = 33

# A second thread pays off only when a layer's weights take a while to stream: below ~1 MB per
# layer (the tiny test models) the phases are so short that meeting at them costs more than the
# thread gives, and its spinning takes CPU from the gateway beside it. That holds for the tiny
# model's wide prompt steps too: alone, 2 threads ran a 128-token prompt in 2.68 ms against 2.99
# on one, but served at 16 streams (guidellm, 20 s, alternating twice) the second thread cost
# 2038-2134 -> 1563-1662 tok/s and TTFT p50 123 -> 144-156 ms, the gateway's core taken from it.
MIN_PARALLEL_LAYER_FLOATS = 1 << 18
# ...except where one sequence's prompt is the whole step: at one stream nothing else runs (the
# gateway waits for this token), and a prompt's phases are long enough to split. The tiny model's
# 128-token prompt step on an AMD EPYC (Zen 4, whose AVX-512 units are half as wide): 2.05 ms on 2
# threads vs 3.31 on one (the engine's step, alternating in one process, 2026-12-06). Each output
# row is computed by one thread whatever the count, so the results are the same bit for bit.
ALONE_PARALLEL_MIN_TOKENS = WIDE_MIN_TOKENS

# Builds whose CPUs run every model's layers on every thread, small ones too, and split a small model's
# long float32 steps into fused passes as they do a large one's (_splits_float32). On an Intel Xeon
# (AVX-512, 2 MB L2 a core, 2026-12-07) the tiny model's 3.1 MB of layers do not stay in a core's L2,
# and one thread streams them from L3 at DRAM-like rates: the engine's forward, 2 threads against 1,
# 1.19x at batch 1, 1.21x at 4, 1.45x at 16; 4 x 128 prompt tokens as fused passes 1.79x faster than
# one PyTorch pass quiet, 2.45x beside a busy core (split_passes_ab_tiny_xeon). Served (serve_ab, tiny,
# 3 alternating pairs of 30 s): 16 streams tok/s 1.075x, TTFT p50 0.72x; 4 streams 1.04x, TTFT 0.70x;
# 1 stream level (1.00x; the threads without the split: TTFT 0.86x at 4 streams, level at 16).
# AMD EPYC with AVX-512 (Zen 5 class, 1 MB L2 a core, 2026-12-07): decode steps alone gain nothing
# (the engine's step, 16 alternating pairs, small_layer_threads_ab_tiny_zen5: one thread / every thread
# 0.93x at batch 1, 0.96x at 4, 1.02x at 16: its forward is a small part of a 0.13-0.5 ms step), but
# the prompts do: 4 x 128 prompt tokens as fused passes on both threads 2.51x faster than one PyTorch
# pass quiet, 4.12x beside a busy core (split_passes_ab_tiny_zen5). Served (serve_ab, tiny, 3
# alternating pairs of 30 s, serve_ab_tiny_small_layers_parallel_*_zen5): 16 streams tok/s 1.25x,
# TTFT p50 0.67x; 4 streams 1.085x, TTFT 0.79x; 1 stream 1.015x, TTFT 0.89x. Zen 4 (also 1 MB of L2)
# not measured again. The AVX2 build keeps the measurements above. Each output row is one thread's
# work whatever the count, and the passes give the same logits, so the results are the same.
PARALLEL_SMALL_LAYERS = {"avx512": True}  # AMD's AVX-512 CPUs as Intel's ("avx512/amd" falls back to it)

# Of a small model's steps on a build listed above, the narrow ones (decode rows, under WIDE_MIN_TOKENS
# tokens) take every thread from this many tokens on; fewer run on one. In service a decode step's
# second thread meets its phases on the core the gateway and the client need between steps, and one
# row is too little work to pay for that. AMD EPYC with AVX-512 (Zen 4 class, 2026-12-07; the tiny
# model): alone, both threads made its decode steps 1.11x / 1.16x / 1.25x faster at batch 1 / 4 / 16
# (small_layer_threads_ab_tiny_zen4). Served (serve_ab, alternating pairs of 30 s): every step on
# both threads (ca67174) against none (e371686), 1 stream tok/s 0.85x (3 of 3 pairs), ITL 1.23x;
# every narrow step on one thread against both, 1 stream 1.09x (3 of 3), but 4 streams 0.89x (3 of 3,
# ITL 1.22x), 16 streams 0.93x; one-row steps alone on one thread (this entry) against both, 1 stream
# tok/s 1.13x over 6 pairs (4 better; 0.86x over 3 more, 1 better), TTFT p50 0.92x, ITL p50 0.84x.
# Intel keeps both threads for every step (its tiny layers stream from L3 on one: 1.19x-1.45x alone,
# 1 stream level served); Zen 5's 1-stream ITL was 1.06x worse with both too.
PARALLEL_SMALL_DECODE_MIN_TOKENS = {"avx512": 1, "avx512/amd": 2}


# Layers whose weights together take at most this many bytes are taken to stay in cache from one
# step to the next (half the smallest L3 seen here, a Zen 2 CCX's 16 MB, leaving room for the KV
# cache and the other processes): where native.tiles_in_cache() (AMD without AVX-512) their few-row
# steps run the tiles, not one weight row at a time (gemm_tiles.h, rows_in_turn_for: that pays
# there only where the weights stream from memory; on a Zen 4 EPYC the rows in turn win in cache too).
CACHED_WEIGHT_BYTES = 8 << 20


# Builds on which a float32 step past the fused path's limit runs faster as fused passes of up to
# the limit than as one pass of PyTorch's layers, for models whose layers take every thread
# (MIN_PARALLEL_LAYER_FLOATS). AMD EPYC with AVX-512 (Zen 4 class, 2026-12-06, LLMEngine.step of
# the prompts alone, alternating in one process): SmolLM2-135M 4 x 128 tokens 680 vs 836 ms, 16 x
# 128 2512 vs 3186 ms; the tiny model on one thread 13.3 vs 10.5 ms at 4 x 128 (it kept one pass
# until its layers took every thread there too: PARALLEL_SMALL_LAYERS, 2.51x on a Zen 5). On Intel
# MKL's large GEMMs win on a quiet machine, but not in service: MKL's OpenMP regions wait at every
# barrier for a thread whose core the gateway or the client took, while the fused passes' threads
# claim chunks. Intel Xeon (AVX-512, no AMX exposed; 2026-12-07,
# benchmarks/split_passes_ab.py, results split_passes_ab_xeon: LLMEngine.step of 4 x 128-token
# prompts, a 256-token budget, 4 alternating pairs): quiet, fused passes 750 ms vs one MKL pass 717
# (0.97x); beside one busy core (what serving looks like), 1281 vs 2550 ms (2.00x).
# AMD EPYC without AVX-512 (Zen 2, the AVX2 build's wide steps; 2026-12-07, cpu_kernel_steps_zen2_wide):
# a 256-token pass 1.39x PyTorch's (1.48 against 2.06 ms a token), and MKL's per-token cost falls
# little past 256 rows (2.44 ms at 128), so longer steps run as passes of 256.
SPLITS_FLOAT32_STEPS = {"avx512/amd": True, "avx512": True, "avx2/amd": True}


@functools.cache
def _parallel_small_layers() -> bool:
    return native.tuned(PARALLEL_SMALL_LAYERS, _variant(), False)


@functools.cache
def _parallel_small_decode_min_tokens() -> int:
    return native.tuned(PARALLEL_SMALL_DECODE_MIN_TOKENS, _variant(), WIDE_MIN_TOKENS)


def _step_threads(layer_weights: int, num_seqs: int, num_tokens: int) -> int:
    """The threads a fused step runs on: every thread for large layers, for a prompt alone in its
    step, and for a small model's steps where the build lists them (PARALLEL_SMALL_LAYERS: wide
    steps, and narrow ones from PARALLEL_SMALL_DECODE_MIN_TOKENS tokens); else one."""
    every = torch.get_num_threads()
    if layer_weights >= MIN_PARALLEL_LAYER_FLOATS:
        return every
    if num_seqs == 1 and num_tokens >= ALONE_PARALLEL_MIN_TOKENS:
        return every
    if _parallel_small_layers() and num_tokens >= min(WIDE_MIN_TOKENS, _parallel_small_decode_min_tokens()):
        return every
    return 1


def _layers_take_every_thread(layer_weights: int) -> bool:
    """Whether a model with this many weights a layer runs its wide steps on every thread (its
    narrow ones by PARALLEL_SMALL_DECODE_MIN_TOKENS: _step_threads), and so splits its long float32
    steps into fused passes (_splits_float32)."""
    return layer_weights >= MIN_PARALLEL_LAYER_FLOATS or _parallel_small_layers()


def _splits_float32(model: DecoderModel) -> bool:
    # The AVX2 build forced onto an AVX-512 CPU never splits (MAX_TOKENS_AVX2_ON_AVX512 is its limit).
    if native.avx2_on_avx512(_variant()):
        return False
    if not native.tuned(SPLITS_FLOAT32_STEPS, _variant(), False):
        return False
    return _layers_take_every_thread(model.config.layer_weights)


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "q_norm", "k_norm", "qkv_w", "qkv_b", "o_w", "o_b",
        "gate_up_w", "gate_up_b", "down_w", "down_b", "k_cache", "v_cache")]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "block_size")] + [
        ("eps", ctypes.c_float), ("residual_multiplier", ctypes.c_float), ("attention_scale", ctypes.c_float),
        ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p), ("weight_bf16", ctypes.c_int64),
        ("weights_cached", ctypes.c_int64)]  # fmt: skip


class _Batch(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int64), ("num_seqs", ctypes.c_int64), ("max_blocks", ctypes.c_int64)] + [
        (name, ctypes.c_void_p) for name in ("cos", "sin", "slot_mapping", "query_start", "seq_lens", "block_tables")] + [
        ("wide", ctypes.c_int64)]


def _declare(fn) -> None:
    p = ctypes.c_void_p
    fn.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Batch), p, p, ctypes.c_int]
    fn.restype = ctypes.c_int


_kernel = native.NativeFunction("cpu_decoder.cpp", "tandem_decoder_forward", _declare)


def available() -> bool:
    return bool(_kernel.get())


def unavailable_reason() -> str:
    _kernel.get()
    return _kernel.reason


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The native description of one model over one set of KV caches (rebuilt when either moves)."""

    def __init__(self, model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cfg = model.config
        first = model.layers[0]
        self.key = self.key_of(model, kv_caches)
        # Held while this view lives: the C side keeps every layer's cache address, and key_of
        # checks only the first and last; were a cache freed (a test's runner dropped), a new one
        # could take the first / last addresses while a middle layer's moved, and the stale view
        # would read and write freed memory. (The weights are the model's: alive as long as it.)
        self._caches = [t for pair in kv_caches for t in pair]
        self.layers = (_Layer * len(model.layers))()
        for dst, layer, (k_cache, v_cache) in zip(self.layers, model.layers, kv_caches):
            attn, mlp = layer.attn, layer.mlp
            dst.input_norm, dst.post_norm = _ptr(layer.input_norm.weight), _ptr(layer.post_attn_norm.weight)
            dst.q_norm = _ptr(attn.q_norm.weight) if attn.q_norm is not None else None
            dst.k_norm = _ptr(attn.k_norm.weight) if attn.k_norm is not None else None
            dst.qkv_w, dst.qkv_b = _ptr(attn.qkv_proj.weight), _ptr(attn.qkv_proj.bias)
            dst.o_w, dst.o_b = _ptr(attn.o_proj.weight), _ptr(attn.o_proj.bias)
            dst.gate_up_w, dst.gate_up_b = _ptr(mlp.gate_up_proj.weight), _ptr(mlp.gate_up_proj.bias)
            dst.down_w, dst.down_b = _ptr(mlp.down_proj.weight), _ptr(mlp.down_proj.bias)
            dst.k_cache, dst.v_cache = _ptr(k_cache), _ptr(v_cache)
        self.desc = _Model(
            num_layers=len(model.layers), hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            block_size=kv_caches[0][0].shape[1], eps=cfg.rms_norm_eps, residual_multiplier=cfg.residual_multiplier,
            attention_scale=first.attn.scale, layers=self.layers, final_norm=_ptr(model.norm.weight),
            weight_bf16=int(first.attn.qkv_proj.weight.dtype == torch.bfloat16),
            weights_cached=int(native.tiles_in_cache() and cfg.layer_weights * cfg.num_layers
                               * first.attn.qkv_proj.weight.element_size() <= CACHED_WEIGHT_BYTES),
        )  # fmt: skip
        self.rotary = model.rotary
        self.layer_weights = cfg.layer_weights  # decides whether its phases pay a second thread

    @staticmethod
    def key_of(model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple:
        return (len(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr(),
                model.layers[0].attn.qkv_proj.weight.data_ptr(), model.norm.weight.data_ptr())  # fmt: skip

    @staticmethod
    def supports(model: DecoderModel, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata) -> bool:  # fmt: skip
        """Whether this batch may take the native path (checked per step; the kernel is built last)."""
        return FusedDecoder._may_take(x) and FusedDecoder._takes(model, kv_caches) and FusedDecoder._fits(x, meta)

    @staticmethod
    def takes_batch(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """supports() for the model and caches a FusedDecoder was built for (their _takes held then):
        DecoderModel skips _takes' ~6 us of module attribute lookups a step."""
        return FusedDecoder._may_take(x) and FusedDecoder._fits(x, meta)

    @staticmethod
    def _may_take(x: torch.Tensor) -> bool:
        return (0 < x.shape[0] <= MAX_TOKENS and x.device.type == "cpu" and x.dtype == torch.float32
                and not torch.is_grad_enabled())  # fmt: skip

    @staticmethod
    def _fits(x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The kernel is built and this build takes this many tokens (last: it may build the kernel)."""
        return available() and x.shape[0] <= max_tokens(meta.max_query_len <= SHORT_QUERY)

    @staticmethod
    def _takes(model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether this path can run the model over these caches at all (what no batch changes)."""
        if model.layers[0].attn.backend.name != "torch":
            return False
        if model.layers[0].attn.qkv_proj.weight.dtype not in (torch.float32, torch.bfloat16):
            return False
        k_cache = kv_caches[0][0]
        return k_cache.dtype == torch.float32 and k_cache.is_contiguous()

    @staticmethod
    def pass_limits(model: DecoderModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int] | None:
        """(any step, a step of short queries): the most tokens a pass should hold where this path
        takes its passes and a longer step is cheaper as several of them (ModelRunner.execute):
        weights stored in bf16 (past the limit PyTorch's path would widen every matrix to a float32
        copy per pass), or float32 weights on a build that SPLITS_FLOAT32_STEPS. None: no limit
        (elsewhere MKL's GEMMs only gain with more rows)."""
        if not getattr(model, "use_fused_cpu", False):
            return None
        if model.device.type != "cpu" or model.dtype != torch.float32 or not FusedDecoder._takes(model, kv_caches):
            return None
        if model.weight_dtype != torch.bfloat16 and not _splits_float32(model):
            return None
        return (max_tokens(False), max_tokens(True)) if available() else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] embedded inputs (consumed) -> the final norm's output [T, hidden]."""
        x = x.contiguous()
        out = torch.empty_like(x)
        # The rope tables whole [max_positions, head_dim // 2]: the kernel reads each token's row
        # at the position it derives from seq_lens (`positions` holds the same numbers).
        cos, sin = self.rotary.cos, self.rotary.sin
        slots = meta.slot_mapping.to(torch.int64).contiguous()  # no-ops for the runner's metadata
        starts = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        batch = _Batch(
            num_tokens=x.shape[0], num_seqs=len(meta.seq_lens_cpu), max_blocks=tables.shape[1],
            cos=cos.data_ptr(), sin=sin.data_ptr(), slot_mapping=slots.data_ptr(), query_start=starts.data_ptr(),
            seq_lens=seq_lens.data_ptr(), block_tables=tables.data_ptr(), wide=int(x.shape[0] >= WIDE_MIN_TOKENS),
        )  # fmt: skip
        threads = _step_threads(self.layer_weights, batch.num_seqs, batch.num_tokens)
        if _kernel.get()(ctypes.byref(self.desc), ctypes.byref(batch), x.data_ptr(), out.data_ptr(), threads) != 0:
            raise MemoryError("fused CPU decoder: no scratch memory")
        return out
