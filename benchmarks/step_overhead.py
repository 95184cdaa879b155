"""Scheduler + sampler overhead as a share of step time, at 64 running sequences.

The engine records per-step timings (schedule, model, sample, bookkeeping = stop checks and
incremental detokenization). We run 64 requests in steady decode and report the mean split;
the target's overhead is scheduler + sampler; the share with bookkeeping is reported beside it.

    python benchmarks/step_overhead.py [--sizes small tiny]
"""

from __future__ import annotations

import argparse
import random

import torch

from bench_common import model_dir, print_table, write_result
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams


def measure(size: str, temperature: float, steps: int) -> dict:
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir("llama", size)), dtype="float32", device="cpu",
            cache=CacheConfig(num_kv_blocks=64 * 40),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
        ),
        detokenize=True,
    )  # fmt: skip
    rng = random.Random(0)
    for i in range(64):
        prompt = [rng.randrange(8, 1000) for _ in range(rng.randint(64, 256))]
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=50, max_tokens=steps + 20,
                                ignore_eos=True, seed=i if temperature else None)  # fmt: skip
        engine.add_request(str(i), params=params, prompt_token_ids=prompt)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    totals = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "bookkeeping": 0.0, "total": 0.0}
    for _ in range(steps):
        engine.step()
        assert engine.last_step.num_seqs == 64
        for k in totals:
            totals[k] += getattr(engine.last_step, k)
    for rid in list(engine._children):
        engine.abort_request(rid)
    overhead = (totals["schedule"] + totals["sample"]) / totals["total"]
    with_bookkeeping = (totals["schedule"] + totals["sample"] + totals["bookkeeping"]) / totals["total"]
    return {"model": f"llama-{size}", "temperature": temperature, "steps": steps,
            **{f"{k}_ms_per_step": v / steps * 1e3 for k, v in totals.items()}, "overhead_fraction": overhead,
            "overhead_with_bookkeeping_fraction": with_bookkeeping}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["small", "tiny"])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = [measure(size, t, args.steps) for size in args.sizes for t in (0.0, 0.8)]
    table = print_table(
        "Step time split at 64 running sequences (decode)",
        ["model", "temperature", "schedule ms", "model ms", "sample ms", "stop checks+detokenize ms", "step ms",
         "scheduler+sampler share", "with stop checks+detokenize"],
        [[r["model"], r["temperature"], r["schedule_ms_per_step"], r["model_ms_per_step"], r["sample_ms_per_step"],
          r["bookkeeping_ms_per_step"], r["total_ms_per_step"], r["overhead_fraction"],
          r["overhead_with_bookkeeping_fraction"]] for r in results],
    )  # fmt: skip
    write_result("step_overhead", {"results": results, "table": table, "target": "overhead_fraction <= 0.15"})


if __name__ == "__main__":
    main()
