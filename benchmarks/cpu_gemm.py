"""Small-batch linear layers on the CPU: the compiled kernel (common/kernels) vs torch's F.linear.

Shapes are the `small` model's: 12 layers of qkv (768->1280), o (768->768), gate_up (768->6144)
and down (3072->768), each layer's weights distinct so they stream from memory as in a real
forward pass (~415 MB, beyond any cache). For each row count M we time all 48 matmuls, best of
several repeats, both ways in the same process. The ratio `cost(M) / cost(1)` is what
speculative verification pays for scoring k + 1 tokens instead of one.

    .venv/bin/python benchmarks/cpu_gemm.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench_common import print_table, write_result

from common.kernels import small_gemm as sg

LAYERS = 12
SHAPES = [(768, 1280), (768, 768), (768, 6144), (3072, 768)]  # (in, out)


def time_pass(fn, weights, rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k, _ in SHAPES}

    def one_pass() -> None:
        for layer in weights:
            for (k, _), w in zip(SHAPES, layer):
                fn(xs[k], w)

    one_pass()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not sg.available():
        raise SystemExit(f"kernel unavailable: {sg.unavailable_reason()}")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for k, n in SHAPES] for _ in range(LAYERS)]
    rows_list = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    results, rows = [], []
    base = {}
    for m in rows_list:
        torch_ms = time_pass(F.linear, weights, m, args.repeats)
        kernel_ms = time_pass(sg.small_gemm, weights, m, args.repeats)
        base.setdefault("torch", torch_ms)
        base.setdefault("kernel", kernel_ms)
        results.append(dict(rows=m, torch_ms=round(torch_ms, 2), kernel_ms=round(kernel_ms, 2),
                            speedup=round(torch_ms / kernel_ms, 3),
                            torch_cost_vs_1_row=round(torch_ms / base["torch"], 3),
                            kernel_cost_vs_1_row=round(kernel_ms / base["kernel"], 3)))  # fmt: skip
        rows.append([m, torch_ms, kernel_ms, torch_ms / kernel_ms, torch_ms / base["torch"], kernel_ms / base["kernel"]])
    table = print_table(f"Small-batch linear layers, `small` model shapes x {LAYERS} layers, {args.threads} thread(s)",
                        ["rows", "torch F.linear ms", "kernel ms", "kernel speedup", "torch cost vs 1 row",
                         "kernel cost vs 1 row"], rows)  # fmt: skip
    path = write_result("cpu_gemm", dict(
        target="a k+1 = 5 row pass close to a 1 row pass (speculative verification); never slower than torch up to MAX_ROWS",
        max_rows=sg.MAX_ROWS, threads=args.threads, results=results, table=table))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
