"""The native CPU kernels of a git revision against the working tree's, alternating in one process.

    python benchmarks/kernel_ab.py --base fce6655 [--models smollm2-135m-instruct tiny] [--repeats 8]

The base revision's common/kernels sources (cpu_decoder.cpp, small_gemm.cpp, gemm_tiles.h) are
written to a temporary folder and built with this tree's flags; each repeat times both builds,
order flipped every repeat, on one engine per batch size (the builds switch between timed runs,
so a neighbour's load falls on both alike):
- decode batch B: LLMEngine.step() median of 10 steady greedy steps, B requests of 128-token prompts;
- prefill N: one request of N prompt tokens to its first token (the first repeat dropped: warm-up).
`base_over_new` is the median of the per-repeat ratios (> 1: the working tree is faster).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from common.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.kernels import cpu_decoder, native, small_gemm  # noqa: E402
from common.sampling.params import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOURCES = (*native.KERNELS, *native.HEADERS)
STEPS = 10  # engine steps per timed run


def checkout_kernels(rev: str, into: Path) -> Path:
    for name in SOURCES:
        text = subprocess.run(["git", "show", f"{rev}:common/kernels/{name}"], cwd=ROOT, check=True,
                              capture_output=True).stdout  # fmt: skip
        (into / name).write_bytes(text)
    return into


def use(sources: Path) -> None:
    """Loads the kernels built from `sources` on the next call (native.build reads native.HERE)."""
    native.HERE = sources
    for kernel in (small_gemm._kernel, cpu_decoder._kernel):
        kernel.forget()
    if not cpu_decoder._kernel.get():
        raise RuntimeError(f"kernels from {sources} unavailable: {cpu_decoder.unavailable_reason()}")


def engine(path: Path, batch: int, blocks: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=batch)))  # fmt: skip


def decode(path: Path, batch: int, ways: dict[str, Path], repeats: int) -> dict[str, list[float]]:
    e = engine(path, batch, batch * 40)
    rng = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(8, e.model_config.vocab_size, (128,), generator=rng).tolist()
        e.add_request(str(i), params=SamplingParams(temperature=0.0, max_tokens=repeats * 2 * (STEPS + 1) + 8, ignore_eos=True),
                      prompt_token_ids=prompt)  # fmt: skip
    while any(r.num_output_tokens == 0 for r in e.scheduler.requests.values()):
        e.step()
    times: dict[str, list[float]] = {w: [] for w in ways}
    names = list(ways)
    for rep in range(repeats):
        for way in names if rep % 2 == 0 else names[::-1]:
            use(ways[way])
            e.step()  # warm: the build loaded
            steps = []
            for _ in range(STEPS):
                e.step()
                assert e.last_step.num_seqs == batch
                steps.append(e.last_step.total * 1e3)
            times[way].append(statistics.median(steps))
    return times


def prefill(path: Path, tokens: int, ways: dict[str, Path], repeats: int) -> dict[str, list[float]]:
    e = engine(path, 4, 200)
    rng = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {w: [] for w in ways}
    names = list(ways)
    for rep in range(repeats + 1):
        for way in names if rep % 2 == 0 else names[::-1]:
            use(ways[way])
            prompt = torch.randint(8, e.model_config.vocab_size, (tokens,), generator=rng).tolist()
            e.add_request(f"{way}{rep}", params=SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=prompt)
            t = time.perf_counter()
            while e.scheduler.requests:
                e.step()
            if rep:  # the first repeat warms both builds
                times[way].append((time.perf_counter() - t) * 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision whose kernels are the baseline")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "tiny"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--prefill", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="kernel_ab", help="results file: benchmarks/results/NAME.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
    results, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ways = {"base": checkout_kernels(args.base, Path(tmp)), "new": native.HERE}
        for model in args.models:
            path = bench_model(model)
            cases = [(f"decode batch {b}", lambda b=b: decode(path, b, ways, args.repeats)) for b in args.batches]
            cases += [(f"prefill {n}", lambda n=n: prefill(path, n, ways, args.repeats)) for n in args.prefill]
            for label, run in cases:
                t = run()
                ratio = statistics.median(a / b for a, b in zip(t["base"], t["new"]))
                base, new = statistics.median(t["base"]), statistics.median(t["new"])
                results.append(dict(model=model_label(model), case=label, base_ms=round(base, 2), new_ms=round(new, 2),
                                    base_over_new=round(ratio, 3), base_runs=t["base"], new_runs=t["new"]))  # fmt: skip
                rows.append([model_label(model), label, base, new, ratio])
                print(rows[-1], flush=True)
        native.HERE = ways["new"]
    table = print_table(f"kernel_ab: kernels of {base_rev} (base) vs the working tree (new), {args.threads} threads",
                        ["model", "case", "base ms", "new ms", "base / new (paired median)"], rows)  # fmt: skip
    path = write_result(args.name, {"base": base_rev, "threads": args.threads, "repeats": args.repeats,
                                    "results": results, "table": table})  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
