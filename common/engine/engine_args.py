"""Command-line flags of the engine, shared by `tandem generate` and the benchmarks."""

from __future__ import annotations

import argparse
import re

from common.config import CacheConfig, EngineConfig, SchedulerConfig

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'512MiB', '2GiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="Hugging Face model folder")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV cache size in blocks")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV cache size, e.g. 2GiB")
    g.add_argument("--gpu-memory-fraction", type=float, default=0.85, help="CUDA: share of free memory for KV")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most running requests")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--seed", type=int, default=0, help="seed for requests without their own")
    g.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        seed=args.seed,
        cache=CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_fraction=args.gpu_memory_fraction,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
        ),
    )
