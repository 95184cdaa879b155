"""The architecture registry: which HF `architectures` names we run, and what each one changes.

All supported models share one decoder (pre-norm, RoPE, SwiGLU, GQA attention); an architecture
only switches features on. Features read from config.json (attention_bias, head_dim, multipliers)
are resolved in `config.py`; this table holds what the HF code hard-wires per architecture.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    short_name: str  # what `make-model --arch` calls it
    qkv_bias_always: bool = False  # Qwen2 has q/k/v biases whatever attention_bias says
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    head_dim_from_config: bool = True  # Qwen2/Granite always use hidden_size // num_heads
    default_head_dim: int | None = None  # Qwen3 defaults to 128 when head_dim is absent
    granite_multipliers: bool = False  # embedding/attention/residual multipliers + logits_scaling
    sliding_window_flag: bool = False  # Qwen: sliding_window only counts if use_sliding_window


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("llama"),
    "Qwen2ForCausalLM": ArchSpec(
        "qwen2", qkv_bias_always=True, head_dim_from_config=False, sliding_window_flag=True
    ),
    "Qwen3ForCausalLM": ArchSpec("qwen3", qk_norm=True, default_head_dim=128, sliding_window_flag=True),
    "MistralForCausalLM": ArchSpec("mistral"),
    "GraniteForCausalLM": ArchSpec("granite", head_dim_from_config=False, granite_multipliers=True),
}

SHORT_NAMES: dict[str, str] = {spec.short_name: arch for arch, spec in ARCHITECTURES.items()}


def get_arch_spec(architecture: str) -> ArchSpec:
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return spec
