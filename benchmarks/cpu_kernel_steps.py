"""A real model's forward step on the CPU with each build of the native kernels, in one run.

Each way is a TANDEM_CPU_GEMM setting (common/config.py): "avx512" and "avx2" (the fused decoder,
cpu_decoder.cpp, and the small-batch GEMM for the logits, on that build; "avx512" only where the CPU
has it) and "off" (PyTorch's layers over MKL); "<build>-dot" is the best build with its wide steps
turned off (every step on the dot-product tiles: cpu_decoder.WIDE_MIN_TOKENS), the before of the
wide steps (2026-12-05 on AVX-512, 2026-12-07 on AVX2). The ways are timed in interleaved repeats (the order rotates each repeat), so a
neighbour's load falls on all of them alike; each reports its best step and `avx512 vs avx2` is
the median of the per-repeat ratios (paired). Two tables:

- steps: the model forward plus the logits of every token, as the engine runs a decode step of B
  sequences (1 token each) or a verification pass of B sequences x (k + 1) tokens;
- crossover: the forward alone for T tokens, as T decoding sequences and as one fresh prompt's
  prefill chunk, with the fused path allowed up to the largest count asked (--crossover), to place cpu_decoder's limits
  where PyTorch's path starts to win, for each shape (cpu_decoder.max_tokens()).

- engine: LLMEngine.step() (scheduler, forward, sampler, bookkeeping) in steady greedy decode of
  1 / 4 / 16 requests (128-token prompts), the build switched between timed runs of steps.

Decoding sequences have `--context` tokens cached (zeros: timing only). The load average is
recorded.

    .venv/bin/python benchmarks/cpu_kernel_steps.py [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from bench_common import bench_model, model_label, print_table, write_result

from common.attention.metadata import AttentionMetadata
from common.config import CPU_GEMM_ENV, CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.kernels import cpu_decoder, native, small_gemm
from common.models.loader import load_model
from common.sampling.params import SamplingParams

STEPS = [(1, 1), (4, 1), (16, 1), (4, 5), (16, 5)]  # (sequences, tokens per sequence)
CROSSOVER = [16, 24, 32, 48, 64, 96, 128]  # tokens: as that many decoding sequences, and as one prefill chunk
BLOCK = 16


WIDE_MIN_TOKENS = cpu_decoder.WIDE_MIN_TOKENS
DOT = "-dot"  # a build's name + DOT: that build with its wide steps off


def use(setting: str) -> None:
    os.environ[CPU_GEMM_ENV] = setting.removesuffix(DOT)
    cpu_decoder.WIDE_MIN_TOKENS = 1 << 30 if setting.endswith(DOT) else WIDE_MIN_TOKENS
    for kernel in (small_gemm._kernel, cpu_decoder._kernel):
        kernel.forget()


class Batch:
    """num_seqs sequences of `context` cached tokens, each adding `tokens` new ones."""

    def __init__(self, model, cfg, num_seqs: int, tokens: int, context: int) -> None:
        per_seq = (context + tokens + BLOCK - 1) // BLOCK
        shape = (num_seqs * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.model = model
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
        tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(num_seqs)]
        self.meta = AttentionMetadata.build([tokens] * num_seqs, [context + tokens] * num_seqs, tables, BLOCK)
        self.ids = torch.randint(8, cfg.vocab_size, (num_seqs * tokens,))
        self.positions = torch.arange(context, context + tokens).repeat(num_seqs)

    def run(self, logits: bool) -> float:
        t = time.perf_counter()
        hidden = self.model(self.ids, self.positions, self.kv, self.meta)
        if logits:
            self.model.compute_logits(hidden)
        return (time.perf_counter() - t) * 1e3


def compare(batches: dict, ways: list[str], repeats: int, logits: bool) -> dict:
    """label -> {way: [ms per repeat]}; batches: label -> a function making the batch (one at a
    time: the caches of 128 sequences take ~1.6 GB); every way of it is timed before the next."""
    out = {}
    for label, make in batches.items():
        batch = make()
        times: dict[str, list[float]] = {w: [] for w in ways}
        for rep in range(repeats):
            for way in ways[rep % len(ways):] + ways[: rep % len(ways)]:
                use(way)
                batch.run(logits)  # warm: the build loaded, the caches touched
                times[way].append(batch.run(logits))
        out[label] = times
        print(label, {w: round(min(t), 1) for w, t in times.items()}, flush=True)
        del batch
    return out


ENGINE_BATCHES = [1, 4, 16]
ENGINE_STEPS = 8  # engine steps per timed run


def engine_steps(path, ways: list[str], repeats: int) -> dict:
    """"B requests" -> {way: [ms per engine step, one mean per repeat]}, steady greedy decode."""
    out = {}
    rng = torch.Generator().manual_seed(0)
    for batch in ENGINE_BATCHES:
        engine = LLMEngine(EngineConfig(
            model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=batch * 40),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=batch)))  # fmt: skip
        steps = repeats * len(ways) * (ENGINE_STEPS + 1) + 4
        for i in range(batch):
            prompt = torch.randint(8, engine.model_config.vocab_size, (128,), generator=rng).tolist()
            engine.add_request(str(i), params=SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                               prompt_token_ids=prompt)  # fmt: skip
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            engine.step()
        times: dict[str, list[float]] = {w: [] for w in ways}
        for rep in range(repeats):
            for way in ways[rep % len(ways):] + ways[: rep % len(ways)]:
                use(way)
                engine.step()  # warm: the build loaded
                total = 0.0
                for _ in range(ENGINE_STEPS):
                    engine.step()
                    assert engine.last_step.num_seqs == batch
                    total += engine.last_step.total
                times[way].append(total / ENGINE_STEPS * 1e3)
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)
        label = f"{batch} requests"
        out[label] = times
        print(label, {w: round(min(t), 1) for w, t in times.items()}, flush=True)
        del engine
    return out


def rows_of(times: dict, ways: list[str]) -> tuple[list[dict], list[list]]:
    """Per batch: best ms of each way, the best build's (ways[0]) paired speedups over its dot-product
    steps and over avx2 (where it is avx512), each build over off."""
    results, rows = [], []
    top = ways[0]
    others = [w for w in ways[1:] if w != "off"]
    for label, t in times.items():
        med = {w: min(t[w]) for w in ways}
        paired = {o: statistics.median(a / b for a, b in zip(t[o], t[top])) for o in others}
        results.append(dict(batch=label, **{f"{w}_ms": round(med[w], 2) for w in ways},
                            **{f"{top}_vs_{'dot' if o.endswith(DOT) else o}": round(r, 3) for o, r in paired.items()},
                            **{f"{w}_vs_off": round(med["off"] / med[w], 3) for w in ways if w != "off"}))  # fmt: skip
        rows.append([label, *(med[w] for w in ways), *paired.values(), *(med["off"] / med[w] for w in ways if w != "off")])
    return results, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-crossover", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--crossover", nargs="+", type=int, default=CROSSOVER, help="token counts of the crossover table")
    ap.add_argument("--name", default="cpu_kernel_steps", help="results file: benchmarks/results/NAME.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native.variant_unsupported("avx2"):
        raise SystemExit(f"avx2: {native.variant_unsupported('avx2')}")
    top = "avx2" if native.variant_unsupported("avx512") else "avx512"
    ways = [top, top + DOT, *(["avx2"] if top != "avx2" else []), "off"]
    path = bench_model(args.model)
    model, cfg = load_model(path, dtype="float32")
    load_before = os.getloadavg()
    steps = {f"{s} x {k}": lambda s=s, k=k: Batch(model, cfg, s, k, args.context) for s, k in STEPS}
    step_times = {} if args.skip_steps else compare(steps, ways, args.repeats, logits=True)
    engine_times = {} if args.skip_engine else engine_steps(path, ways, args.repeats)
    cross_times = {}
    crossover = args.crossover
    if not args.skip_crossover:
        cpu_decoder.MAX_TOKENS = max(crossover)  # let the fused path take every size here
        cpu_decoder.MAX_TOKENS_BY_BUILD = dict.fromkeys(native.VARIANTS, (max(crossover), max(crossover)))
        cpu_decoder.MAX_TOKENS_AVX2_ON_AVX512 = (max(crossover), max(crossover))
        cross = {f"{t} x 1": lambda t=t: Batch(model, cfg, t, 1, args.context) for t in crossover}
        cross |= {f"1 x {t}, prefill": lambda t=t: Batch(model, cfg, 1, t, 0) for t in crossover}
        cross_times = compare(cross, ways, args.repeats, logits=False)
    load_after = os.getloadavg()
    load = f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    headers = [f"{w} ms" for w in ways] + [*(f"{top} vs {o} (paired)" for o in ways[1:] if o != "off"),
                                           *(f"{w} vs off" for w in ways if w != "off")]
    step_results, tables = [], []
    if step_times:
        step_results, step_rows = rows_of(step_times, ways)
        tables.append(print_table(f"{model_label(args.model)} forward + logits per step (sequences x tokens each), "
                                  f"{args.threads} threads, context {args.context}, best of {args.repeats}; {load}",
                                  ["batch", *headers], step_rows))  # fmt: skip
    engine_results = []
    if engine_times:
        engine_results, engine_rows = rows_of(engine_times, ways)
        tables.append(print_table(f"{model_label(args.model)} LLMEngine.step() in steady greedy decode, mean of "
                                  f"{ENGINE_STEPS} steps, best of {args.repeats}; {load}", ["batch", *headers],
                                  engine_rows))  # fmt: skip
    cross_results = []
    if cross_times:
        cross_results, cross_rows = rows_of(cross_times, ways)
        tables.append(print_table(f"{model_label(args.model)} forward only, fused path allowed to {max(crossover)} "
                                  f"tokens (sequences x tokens each); {load}", ["batch", *headers], cross_rows))  # fmt: skip
    path = write_result(args.name, dict(
        model=model_label(args.model), threads=args.threads, context=args.context, repeats=args.repeats,
        load_average_before=load_before, load_average_after=load_after, steps=step_results, engine=engine_results,
        crossover=cross_results, table="\n\n".join(tables)))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
