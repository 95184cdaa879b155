"""Command-line flags of the engine, shared by `tandem generate` and the benchmarks."""

from __future__ import annotations

import argparse

from common.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size


def parse_bytes(text: str) -> int:
    """argparse type for sizes: the grammar of common.config.parse_size (2GiB, 512MiB, 1.5G)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
