"""Small-batch linear layers on the CPU: the compiled kernel's AVX2 and AVX-512 builds
(common/kernels) against torch's F.linear, side by side in one run.

Shapes are the `small` model's: 12 layers of qkv (768->1280), o (768->768), gate_up (768->6144)
and down (3072->768), each layer's weights distinct so they stream from memory as in a real
forward pass (~415 MB, beyond any cache). For each row count M one pass is all 48 matmuls; the
three ways are timed in interleaved repeats (the order rotates each repeat) so a neighbour's load
falls on all of them alike, and each reports its best pass. `avx512 vs avx2` is the median of the
per-repeat ratios (paired), the figure to compare across runs on a shared machine. The ratio
`cost(M) / cost(1)` is what speculative verification pays for scoring k + 1 tokens instead of one.
The load average is recorded with the results.

    .venv/bin/python benchmarks/cpu_gemm.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from bench_common import print_table, write_result

from common.kernels import native
from common.kernels import small_gemm as sg

LAYERS = 12
SHAPES = [(768, 1280), (768, 768), (768, 6144), (3072, 768)]  # (in, out)
ROWS = [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def one_pass(fn, weights, xs) -> float:
    t = time.perf_counter()
    for layer in weights:
        for (k, _), w in zip(SHAPES, layer):
            fn(xs[k], w)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ways = {"torch": F.linear}
    for variant in native.VARIANTS:
        if sg._kernel.get(variant):
            ways[variant] = lambda x, w, v=variant: sg.small_gemm(x, w, variant=v)
        else:
            print(f"{variant} build unavailable: {sg._kernel.reason_for(variant)}")
    if len(ways) == 1:
        raise SystemExit("no kernel build available")
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for k, n in SHAPES] for _ in range(LAYERS)]
    load_before = os.getloadavg()
    results, rows, base = [], [], {}
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k, _ in SHAPES}
        names = list(ways)
        for name in names:
            one_pass(ways[name], weights, xs)  # warm: first touch, page faults
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                times[name].append(one_pass(ways[name], weights, xs))
        best = {name: min(t) for name, t in times.items()}
        for name in names:
            base.setdefault(name, best[name])
        r = dict(rows=m, **{f"{name}_ms": round(best[name], 2) for name in names},
                 **{f"{name}_cost_vs_1_row": round(best[name] / base[name], 3) for name in names})  # fmt: skip
        line = [m, *(best[name] for name in names)]
        if "avx2" in ways and "avx512" in ways:
            paired = statistics.median(a / b for a, b in zip(times["avx2"], times["avx512"]))
            r["avx512_vs_avx2"] = round(paired, 3)
            line.append(paired)
        for name in names[1:]:
            r[f"{name}_vs_torch"] = round(best["torch"] / best[name], 3)
            line.append(best["torch"] / best[name])
        line += [best[name] / base[name] for name in names]
        results.append(r)
        rows.append(line)
        print(r, flush=True)
    load_after = os.getloadavg()
    kernels = [n for n in ways if n != "torch"]
    headers = (["rows", *(f"{n} ms" for n in ways)] + (["avx512 vs avx2 (paired)"] if len(kernels) == 2 else [])
               + [f"{n} vs torch" for n in kernels] + [f"{n} cost vs 1 row" for n in ways])  # fmt: skip
    load = f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    table = print_table(f"Small-batch linear layers, `small` model shapes x {LAYERS} layers, {args.threads} thread(s), "
                        f"best of {args.repeats} interleaved repeats; {load}", headers, rows)  # fmt: skip
    path = write_result("cpu_gemm", dict(
        target="a k+1 = 5 row pass close to a 1 row pass (speculative verification); never slower than torch up to MAX_ROWS",
        max_rows=sg.MAX_ROWS, threads=args.threads, repeats=args.repeats, chosen_variant=native.chosen_variant()[0],
        load_average_before=load_before, load_average_after=load_after, results=results, table=table))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
