"""Engine configuration: frozen, one dataclass per concern, validated once."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Process-wide switches of the CPU kernels (common/kernels), read from the environment because a
# model's layers consult them, not an engine instance. TANDEM_CPU_GEMM: "auto" (default) loads the
# AVX-512 build of the kernels on a CPU with AVX-512 F/BW/VL/DQ and the AVX2 build elsewhere;
# "avx2" forces the AVX2 build; "avx512" forces AVX-512 (the kernels stay off on a CPU without
# it); "off" disables them (PyTorch only). The cache names where they are compiled to (default
# ~/.cache/tandem/kernels).
CPU_GEMM_ENV = "TANDEM_CPU_GEMM"
KERNEL_CACHE_ENV = "TANDEM_KERNEL_CACHE"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5G", "4096" (decimal k/M/G/T, binary Ki/Mi/Gi/Ti)."""
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(f"not a size: {text!r} (use e.g. 2GiB, 512MiB, 1.5G, 4096)")
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {text!r}")
    return value


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the value."""


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides the memory-based sizing below."""
    kv_cache_memory: int | None = None
    """Bytes of KV cache to allocate (all layers, K and V)."""
    gpu_memory_fraction: float = 0.85
    """On CUDA, with neither of the above: fraction of free device memory the cache may take."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained token hash matches a new request's prefix."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ConfigError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget of one step: decodes, prefill chunks and draft tokens together. None: sized by
    the device and model (common/scheduler/step_budget.py: 2048 on a GPU, a step's FLOPs on a CPU)."""
    max_num_seqs: int = 256
    """Most requests running at once."""

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"
    """none, ngram (prompt lookup, in-process) or draft (a proposer given to the engine)."""
    num_speculative_tokens: int = 0
    """Most draft tokens per request per step; each request adapts its own k within it."""
    adaptive: bool = True
    """Adapt each request's k to its acceptance rate and the measured cost of a draft token;
    False drafts num_speculative_tokens every step (fixed k: for measurements and tests)."""
    threads_while_drafting: int | None = None
    """torch threads of a step that verifies drafts; steps without drafts keep the engine's own
    count. On one box a draft worker takes a core while it drafts: the target gives that core
    up only while drafts are in flight, and takes it back when adaptive k turns speculation off
    (large batches), so not speculating costs what it would without a draft. None: no change."""

    def __post_init__(self) -> None:
        if self.threads_while_drafting is not None and self.threads_while_drafting < 1:
            raise ConfigError(f"threads_while_drafting must be >= 1, got {self.threads_while_drafting}")
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 0:
            raise ConfigError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")

    @property
    def enabled(self) -> bool:
        return self.method != "none" and self.num_speculative_tokens > 0


@dataclass(frozen=True)
class StructuredOutputConfig:
    compile_timeout_s: float = 10.0
    """A grammar that takes longer to compile fails its request (a 400), not the server."""
    cache_size: int = 256
    """Compiled grammars kept per engine (LRU), keyed by spec."""

    def __post_init__(self) -> None:
        if not self.compile_timeout_s > 0:
            raise ConfigError(f"compile_timeout_s must be > 0, got {self.compile_timeout_s}")
        if self.cache_size < 1:
            raise ConfigError(f"cache_size must be >= 1, got {self.cache_size}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    """Path of a Hugging Face model folder."""
    dtype: str = "auto"
    """auto (the checkpoint's), float32, bfloat16 or float16."""
    weight_dtype: str = "auto"
    """auto (the dtype) or bfloat16: the weight matrices stored in bf16 (half the bytes a decode
    step streams) while activations, norms and the KV cache stay float32 and the math float32; the
    output is what float32 weights rounded to bf16 give. Needs dtype float32."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda[:N]."""
    attention_backend: str = "auto"
    """auto (triton on CUDA, torch on CPU), torch or triton."""
    max_model_len: int | None = None
    """Longest prompt + output; defaults to the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's generator, used by requests that give no seed."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.weight_dtype not in ("auto", "bfloat16"):
            raise ConfigError(f"weight_dtype must be auto or bfloat16, got {self.weight_dtype!r}")
        if self.weight_dtype == "bfloat16" and self.dtype in ("bfloat16", "float16"):
            raise ConfigError(f"weight_dtype bfloat16 stores float32 models' weights; dtype is {self.dtype}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
