"""Builds a service's engine from its settings."""

from __future__ import annotations

import dataclasses

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig, StructuredOutputConfig
from common.engine.llm_engine import LLMEngine
from services.runtime.settings import CommonSettings, EngineSettings


def engine_config(model: str, engine: EngineSettings, *, seed: int = 0, max_model_len: int | None = None) -> EngineConfig:
    """The one translation of the engine flags (services and `tandem generate`) into EngineConfig."""
    cache = CacheConfig(block_size=engine.block_size, num_kv_blocks=engine.num_kv_blocks,
                        kv_cache_memory=engine.kv_cache_memory, enable_prefix_caching=engine.enable_prefix_caching)
    if engine.gpu_memory_fraction is not None:  # unset: CacheConfig's default
        cache = dataclasses.replace(cache, gpu_memory_fraction=engine.gpu_memory_fraction)
    return EngineConfig(
        model=model, dtype=engine.dtype, weight_dtype=engine.weight_dtype, device=engine.device, attention_backend=engine.attention_backend,
        max_model_len=max_model_len, seed=seed, cache=cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs),
        structured=StructuredOutputConfig(compile_timeout_s=engine.grammar_compile_timeout),
    )  # fmt: skip


def build_engine(common: CommonSettings, engine: EngineSettings, *, detokenize: bool = False) -> LLMEngine:
    if engine.torch_threads:
        torch.set_num_threads(engine.torch_threads)
    return LLMEngine(engine_config(common.model, engine), detokenize=detokenize)


def kv_layout(llm: LLMEngine, model_id: str):
    """The KV layout this engine's pushes and receives use (compared at Handshake)."""
    from common.kv_transfer.compat import KVLayout

    return KVLayout.from_model_config(model_id, llm.model_config, llm.kv.block_size, llm.dtype)
