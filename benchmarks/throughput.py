"""Offline throughput: Tandem's engine vs transformers generate() in static padded batches.

Same model folder, same requests (prompt lengths and output lengths drawn once), greedy, EOS
ignored so every request produces exactly its output length. transformers runs each static batch
until its longest output, so tokens past a request's own length are waste and not counted.

    python benchmarks/throughput.py [--sizes tiny small] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_common import bench_model, make_workload, model_label, print_table, vocab_size, write_result
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams

DEVICE = "cpu"  # benchmarks/gpu_check.py sets "cuda"


def run_tandem(path, wl, max_num_seqs: int, budget: int) -> float:
    max_len = max(len(p) + o for p, o in zip(wl.prompts, wl.output_lens))
    blocks = (max_len // 16 + 2) * max_num_seqs
    engine = LLMEngine(
        EngineConfig(
            model=str(path), dtype="float32", device=DEVICE,
            cache=CacheConfig(num_kv_blocks=blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        ),
        detokenize=False,
    )  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in wl.output_lens]
    start = time.perf_counter()
    outs = engine.generate(wl.prompts, params)
    elapsed = time.perf_counter() - start
    assert sum(len(o[0].token_ids) for o in outs) == wl.num_output_tokens
    return elapsed


def run_transformers(path, wl, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(DEVICE).eval()
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[i : i + batch_size]
            longest = max(len(p) for p in prompts)
            # Left padding, as decoder-only batched generation requires.
            ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=DEVICE)
            mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
            new = max(wl.output_lens[i : i + batch_size])
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"],
                    help="tiny / small (random llama) or real models of tandem fetch-model's catalogue")
    ap.add_argument("--name", default="throughput", help="result file name (benchmarks/results/NAME.json)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--small-num-requests", type=int, default=None, help="fewer requests for the small model")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results, rows = [], []
    for size in args.sizes:
        path = bench_model(size)
        n = args.small_num_requests if size != "tiny" and args.small_num_requests else args.num_requests
        wl = make_workload(n, (32, 1024), (16, 256), vocab=min(1000, vocab_size(path)), seed=0)
        tandem = run_tandem(path, wl, max_num_seqs=256, budget=2048)
        hf8 = run_transformers(path, wl, 8)
        hf32 = run_transformers(path, wl, 32)
        tok = wl.num_output_tokens
        entry = {
            "model": model_label(size), "num_requests": n, "output_tokens": tok,
            "tandem_s": tandem, "hf_batch8_s": hf8, "hf_batch32_s": hf32,
            "tandem_tok_s": tok / tandem, "hf_batch8_tok_s": tok / hf8, "hf_batch32_tok_s": tok / hf32,
            "speedup_vs_best_hf": min(hf8, hf32) / tandem,
        }  # fmt: skip
        results.append(entry)
        rows.append([entry["model"], n, tok, entry["tandem_tok_s"], entry["hf_batch8_tok_s"],
                     entry["hf_batch32_tok_s"], entry["speedup_vs_best_hf"]])  # fmt: skip
        print(entry, flush=True)
    table = print_table(
        "Offline throughput (output tokens/s), prompts 32-1024, outputs 16-256, greedy",
        ["model", "requests", "output tokens", "tandem", "hf batch 8", "hf batch 32", "speedup vs best hf"],
        rows,
    )
    write_result(args.name, {"results": results, "table": table, "target": "speedup_vs_best_hf >= 4"})


if __name__ == "__main__":
    main()
