"""The default step token budget: 2048 on a GPU, sized by a step's FLOPs on a CPU."""

from __future__ import annotations

import pytest

from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.models.config import ModelConfig
from common.scheduler.step_budget import default_max_num_batched_tokens


def _llama(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 8192,
    })  # fmt: skip


SMOLLM2_135M = _llama(576, 1536, 30, 9, 3, 64)
QWEN25_15B = _llama(1536, 8960, 28, 12, 2, 128)
TINY = _llama(128, 384, 4, 4, 2, 32)


@pytest.mark.parametrize("cfg, expected", [(SMOLLM2_135M, 256), (TINY, 2048), (QWEN25_15B, 64)])
def test_cpu_budget_follows_the_model_flops(cfg, expected):
    assert default_max_num_batched_tokens(cfg, "cpu", max_num_seqs=16, block_size=16) == expected


def test_budget_never_splits_a_decode_step_nor_a_block():
    assert default_max_num_batched_tokens(QWEN25_15B, "cpu", max_num_seqs=128, block_size=16) == 128
    assert default_max_num_batched_tokens(QWEN25_15B, "cpu", max_num_seqs=16, block_size=256) == 256


def test_gpu_budget_is_2048_tokens():
    assert default_max_num_batched_tokens(SMOLLM2_135M, "cuda", max_num_seqs=128, block_size=16) == 2048


def test_engine_resolves_an_unset_budget_and_keeps_a_given_one(tiny_model):
    unset = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", cache=CacheConfig(num_kv_blocks=64)),
                      detokenize=False)  # fmt: skip
    assert unset.config.scheduler.max_num_batched_tokens == 2048  # the tiny model: the CPU ceiling
    given = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", cache=CacheConfig(num_kv_blocks=64),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=96)), detokenize=False)  # fmt: skip
    assert given.scheduler.config.max_num_batched_tokens == 96
