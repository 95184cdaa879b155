"""Builds a service's engine from its settings."""

from __future__ import annotations

import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from services.runtime.settings import CommonSettings, EngineSettings


def engine_config(common: CommonSettings, engine: EngineSettings, seed: int = 0) -> EngineConfig:
    return EngineConfig(
        model=common.model,
        dtype=engine.dtype,
        device=engine.device,
        attention_backend=engine.attention_backend,
        seed=seed,
        cache=CacheConfig(
            block_size=engine.block_size,
            num_kv_blocks=engine.num_kv_blocks,
            kv_cache_memory=engine.kv_cache_memory,
            gpu_memory_fraction=engine.gpu_memory_fraction or 0.85,
            enable_prefix_caching=engine.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.max_num_seqs,
        ),
    )


def build_engine(common: CommonSettings, engine: EngineSettings, *, detokenize: bool = False) -> LLMEngine:
    if engine.torch_threads:
        torch.set_num_threads(engine.torch_threads)
    return LLMEngine(engine_config(common, engine), detokenize=detokenize)


def kv_layout(llm: LLMEngine, model_id: str):
    """The KV layout this engine's pushes and receives use (compared at Handshake)."""
    from common.kv_transfer.compat import KVLayout

    return KVLayout.from_model_config(model_id, llm.model_config, llm.kv.block_size, llm.dtype)
