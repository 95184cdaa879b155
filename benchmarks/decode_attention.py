"""Decode attention alone on one thread, from a paged cache whose blocks lie anywhere (issue 10).

    python benchmarks/decode_attention.py [--contexts 150 1000 4000]

Builds benchmarks/native/decode_attention.cpp (which includes cpu_decoder.cpp; AVX-512 build
flags, so it needs an AVX-512 CPU) and runs, for 16 sequences of each context length with
SmolLM2-135M's heads (3 KV heads, 3 query heads each, head_dim 64): one attend_group call per
(token, KV head), one per token for every KV head, and a plain read of the same blocks (the
access pattern's own stream rate). Reports us per (token, KV head) and GB/s of keys and values.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import print_table, write_result  # noqa: E402
from common.kernels import native  # noqa: E402

HERE = Path(__file__).resolve().parent
MODES = ("per-head", "all-heads", "read")


def build(out: Path) -> Path:
    exe = out / "decode_attention"
    flags = [f for f in native.FLAGS if f not in ("-fPIC", "-shared")] + native.VARIANTS["avx512"]
    subprocess.run([native.require_compiler(), *flags, f"-I{native.HERE}", str(HERE / "native" / "decode_attention.cpp"), "-o", str(exe)],
                   check=True)  # fmt: skip
    return exe


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", nargs="+", type=int, default=[150, 1000, 4000])
    ap.add_argument("--name", default="decode_attention")
    args = ap.parse_args()
    if not native.cpu_has_avx512():
        sys.exit("needs an AVX-512 CPU (the harness is built with the avx512 flags)")
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for ctx in args.contexts:
            row = {"context": ctx}
            for mode in MODES:
                out = subprocess.run(["taskset", "-c", "0", str(exe), str(ctx), "3", mode], check=True,
                                     capture_output=True, text=True).stdout.split()  # fmt: skip
                row[f"{mode}_us"], row[f"{mode}_gb_s"] = float(out[0]), float(out[1])
            results.append(row)
            print(row, flush=True)
            rows.append([ctx] + [row[f"{m}_us"] for m in MODES[:2]] + [row[f"{m}_gb_s"] for m in MODES])
    table = print_table(
        "Decode attention on one thread, 16 sequences, SmolLM2-135M's heads, shuffled cache blocks: us per "
        "(token, KV head) and GB/s of keys and values",
        ["context", "per KV head us", "all KV heads us", "per KV head GB/s", "all KV heads GB/s", "plain read GB/s"],
        rows)  # fmt: skip
    write_result(args.name, {"results": results, "table": table})


if __name__ == "__main__":
    main()
