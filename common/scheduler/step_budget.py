"""The default token budget of one engine step, sized by what a token costs on the device.

Chunked prefill keeps a long prompt from stalling the requests that are decoding only if a step's
budget is short in *time*. 2048 tokens is a fraction of a second on a GPU, but on a 2-core CPU
it is seconds for a 135M model: sixteen 128-token prompts arriving together (a closed-loop load's
wave) went into one 2.5 s step, so every one of them waited the whole wave for its first token and
every running stream stalled as long. On a CPU the prompt is FLOP-bound and the fused decoder
runs a long step as passes of <= 256 tokens anyway (cpu_decoder.SPLITS_FLOAT32_STEPS), so smaller
steps cost no throughput; they only let the first prompts of a wave finish first.

Measured (SmolLM2-135M float32, `tandem up`, guidellm, fresh 128-token prompts, 30 s levels, AMD
EPYC 2 cores, 2026-12-06): budget 256 vs 2048 at 16 streams TTFT p50 805 vs 2779 ms, 169 vs 161
tok/s, ITL p50 78 vs 50 ms (decodes now share steps with prompt chunks instead of waiting out
whole waves); at 4 streams TTFT 397 vs 721 ms, 95 vs 101 tok/s.
"""

from __future__ import annotations

from common.models.config import ModelConfig

GPU_TOKENS = 2048
"""Budget on CUDA (and any device but the CPU): fast enough that tokens, not time, bound a step."""
CPU_STEP_FLOPS = 55e9
"""FLOPs of the decoder layers one CPU step may hold by default: 256 tokens of SmolLM2-135M, ~0.3 s
of float32 GEMM on a 2-core AVX-512 CPU."""
CPU_MIN_TOKENS = 64
"""Floor for big models (Qwen2.5-1.5B would get 21): below it a step's GEMMs turn weight-bound."""
CPU_MAX_TOKENS = 2048
"""Ceiling for small models (the tiny test models would get ~35000)."""
ROUND_TO = 16


def layer_flops_per_token(cfg: ModelConfig) -> float:
    """2 x the weights of every decoder layer (the logits are computed for a step's last tokens only)."""
    return 2.0 * cfg.layer_weights * cfg.num_layers


def default_max_num_batched_tokens(cfg: ModelConfig, device_type: str, *, max_num_seqs: int, block_size: int) -> int:
    """The step budget when none is configured (SchedulerConfig.max_num_batched_tokens None). Never
    below max_num_seqs (every running request's decode token fits one step: a decode step split in
    two would stream the weights twice) nor a block."""
    if device_type != "cpu":
        return max(GPU_TOKENS, max_num_seqs, block_size)
    tokens = int(CPU_STEP_FLOPS / layer_flops_per_token(cfg)) // ROUND_TO * ROUND_TO
    return max(CPU_MIN_TOKENS, min(CPU_MAX_TOKENS, tokens), max_num_seqs, block_size)
