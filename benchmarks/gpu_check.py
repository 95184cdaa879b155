"""The device check: on a CUDA machine, test and time the Triton kernels and the engine.

Run as one prepared script (a lent GPU's time is short), e.g.:
    python benchmarks/gpu_check.py --out "$OUT"        # ~3-6 minutes on an H100/H200

1. Kernels: Triton write_kv + paged_attention vs the torch reference on the GPU (fp32/bf16/fp16,
   GQA, decode / chunked prefill / verification mixes), max error; then timings of both.
2. Engine: greedy parity on CUDA against transformers (fp32), tiny model, mixed batch, chunking.
3. Throughput: the offline benchmark (benchmarks/throughput.py's workload) on the small model, vs
   transformers generate() in static batches of 8 and 32, on the GPU.
Writes gpu_check.json (to --out and benchmarks/results/) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_common import make_workload, model_dir, print_table, write_result
from common.attention import triton_kernels
from common.attention.backend import get_attention_backend
from common.attention.reference import paged_attention_reference, write_kv_reference
from tests.kernels.paged_cases import build_case

CASES = [  # (query_lens, seq_lens): decode, chunked prefill, verification, mixed
    ([1] * 64, [37 + 13 * i for i in range(64)]),
    ([512, 256], [512, 1280]),
    ([5] * 16, [300 + 7 * i for i in range(16)]),
    ([1] * 32 + [128, 5, 5], [900] * 32 + [2048, 77, 1000]),
]


def _time(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def check_kernels() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for qlens, slens in CASES:
            q, kc, vc, meta, _, _ = build_case(qlens, slens, 32, 8, 128, 16, dtype, seed=len(qlens))
            q, kc, vc = q.cuda(), kc.cuda(), vc.cuda()
            meta = dataclasses.replace(
                meta, slot_mapping=meta.slot_mapping.cuda(), query_start_loc=meta.query_start_loc.cuda(),
                seq_lens=meta.seq_lens.cuda(), block_tables=meta.block_tables.cuda(),
            )  # fmt: skip
            ref = paged_attention_reference(q, kc, vc, meta, 128**-0.5)
            out = triton_kernels.paged_attention(q, kc, vc, meta, 128**-0.5)
            err = (out.float() - ref.float()).abs().max().item()
            t_ref = _time(lambda: paged_attention_reference(q, kc, vc, meta, 128**-0.5))
            t_tri = _time(lambda: triton_kernels.paged_attention(q, kc, vc, meta, 128**-0.5))
            k = torch.randn(q.shape[0], 8, 128, dtype=dtype, device="cuda")
            kc2, vc2 = kc.clone(), vc.clone()
            write_kv_reference(k, k, kc, vc, meta.slot_mapping)
            triton_kernels.write_kv(k, k, kc2, vc2, meta.slot_mapping)
            rows.append({"dtype": str(dtype).split(".")[-1], "tokens": q.shape[0], "seqs": len(qlens),
                         "max_err": err, "write_kv_equal": bool(torch.equal(kc, kc2)),
                         "torch_ms": t_ref * 1e3, "triton_ms": t_tri * 1e3, "speedup": t_ref / t_tri})  # fmt: skip
    return rows


def check_engine_parity() -> dict:
    from common.models.make_model import make_model
    from tests.engine.engine_helpers import greedy, hf_greedy, random_prompts
    from common.config import CacheConfig, EngineConfig, SchedulerConfig
    from common.engine.llm_engine import LLMEngine

    result = {}
    for arch in ("llama", "qwen3", "granite"):
        path = make_model(arch, "tiny", 0, Path("benchmarks/.models") / f"gpu-{arch}")
        prompts = random_prompts([1, 17, 64, 150, 333], 1000, seed=3)
        expected = hf_greedy(path, prompts, 16)
        engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cuda",
                                        cache=CacheConfig(num_kv_blocks=512),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=64)))  # fmt: skip
        got = [o[0].token_ids for o in engine.generate(prompts, greedy(16))]
        result[arch] = {"equal": got == expected, "attention_backend": get_attention_backend("auto", "cuda").name}
    return result


def check_throughput(num_requests: int) -> dict:
    import throughput

    path = model_dir("llama", "small")
    wl = make_workload(num_requests, (32, 1024), (16, 256), vocab=1000, seed=0)
    throughput.DEVICE = "cuda"
    tandem = throughput.run_tandem(path, wl, max_num_seqs=256, budget=4096)
    hf8 = throughput.run_transformers(path, wl, 8)
    hf32 = throughput.run_transformers(path, wl, 32)
    tok = wl.num_output_tokens
    return {"requests": num_requests, "tandem_tok_s": tok / tandem, "hf8_tok_s": tok / hf8, "hf32_tok_s": tok / hf32,
            "speedup_vs_best_hf": min(hf8, hf32) / tandem}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write the JSON here (e.g. $OUT on the device machine)")
    ap.add_argument("--num-requests", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    report: dict = {"device": torch.cuda.get_device_name(0)}
    for name, fn in (("kernels", check_kernels), ("engine_parity", check_engine_parity),
                     ("throughput", lambda: check_throughput(args.num_requests))):  # fmt: skip
        try:
            report[name] = fn()
        except Exception:  # keep going: a lent GPU's minutes are precious
            report[name] = {"error": traceback.format_exc()}
    kernels = report.get("kernels")
    if isinstance(kernels, list):
        print_table("Triton vs torch paged attention on " + report["device"],
                    ["dtype", "tokens", "seqs", "max err", "write_kv equal", "torch ms", "triton ms", "speedup"],
                    [[r["dtype"], r["tokens"], r["seqs"], r["max_err"], r["write_kv_equal"], r["torch_ms"],
                      r["triton_ms"], r["speedup"]] for r in kernels])  # fmt: skip
    print(json.dumps({k: v for k, v in report.items() if k != "kernels"}, indent=1))
    path = write_result("gpu_check", report)
    if args.out:
        Path(args.out, "gpu_check.json").write_text(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
