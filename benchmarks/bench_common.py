"""Shared pieces of the benchmarks: workloads, model folders, result files and tables."""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(8, vocab) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outs = [rng.randint(*output_range) for _ in range(n)]
    return Workload(prompts, outs)


def model_dir(arch: str, size: str, seed: int = 0) -> Path:
    """Benchmark models live under benchmarks/.models (git-ignored), made once."""
    from common.models.make_model import make_model

    path = ROOT / "benchmarks" / ".models" / f"{arch}-{size}-{seed}"
    if not (path / "config.json").exists():
        make_model(arch, size, seed, path)
    return path


def bench_model(name: str) -> Path:
    """A benchmark model: "tiny" / "small" are seeded random Llamas; any other name is a real model
    of `tandem fetch-model`'s catalogue (e.g. smollm2-135m-instruct), fetched into the fetch cache."""
    if name in ("tiny", "small"):
        return model_dir("llama", name)
    from common.models.model_fetch import cache_dir, fetch_model

    return fetch_model(name, cache_dir() / "models" / name)


def model_label(name: str) -> str:
    return f"llama-{name}" if name in ("tiny", "small") else name


def vocab_size(path: Path) -> int:
    from common.models.config import ModelConfig

    return ModelConfig.from_pretrained(path).vocab_size


def machine_info() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
    return path


def print_table(title: str, headers: list[str], rows: list[list]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [f"## {title}", "| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]  # fmt: skip
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text
