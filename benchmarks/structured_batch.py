"""Does one grammar-constrained request slow the unconstrained ones in its batch? (issue 12, acceptance 5)

Two engines of the same model run in one process, stepped alternately (A B, B A, A B, ...), so load
drift on a shared CPU hits both alike:

    A (baseline)     B + 1 unconstrained requests
    B (constrained)  B unconstrained requests + 1 request constrained by a JSON schema that cannot
                     complete within the run (it stays constrained every step)

The B unconstrained requests are the same in both (prompts, seeds). Every request gets one token
per decode step, so the unconstrained requests' per-token time is the engine's step time; the
figure is the median over step pairs of step(B) / step(A), with its quartiles. The sampler alone is
also timed (same logits, interleaved iterations) to show where the grammar's cost goes.

    python benchmarks/structured_batch.py [--models tiny smollm2-135m-instruct] [--batch 16]
                                          [--steps 60] [--runs 2]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

import torch

from bench_common import bench_model, model_label, print_table, write_result
from common.config import CacheConfig, EngineConfig, SchedulerConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler
from common.structured.compiler import GrammarCompiler
from common.structured.matcher import RequestGrammar
from common.structured.spec import GrammarSpec

# An array of records that must hold 500 items: never complete within a short run.
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 500, "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
        "required": ["name", "age", "tags"], "additionalProperties": False}}},
    "required": ["people"], "additionalProperties": False,
}  # fmt: skip
WARMUP_STEPS = 3  # decode steps per run left out of the figures (first-step allocations)
MAX_PROMPT = 128


def make_engine(path, batch: int, max_tokens: int) -> LLMEngine:
    blocks_per_seq = math.ceil((MAX_PROMPT + max_tokens) / 16) + 1
    engine = LLMEngine(EngineConfig(
        model=str(path), dtype="float32", device="cpu",
        cache=CacheConfig(num_kv_blocks=(batch + 1) * blocks_per_seq, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=batch + 1),
    ), detokenize=True)  # fmt: skip
    engine.grammar_compiler.compile(GrammarSpec.json_schema(SCHEMA))  # compile outside the timing
    return engine


def start(engine: LLMEngine, batch: int, max_tokens: int, constrained: bool, seed: int) -> None:
    """Adds the run's batch + 1 requests and prefills them (each has its first token)."""
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, 1000)
    for i in range(batch + 1):
        prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(32, MAX_PROMPT))]
        grammar = GrammarSpec.json_schema(SCHEMA) if constrained and i == batch else None
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, ignore_eos=grammar is None,
                                seed=seed * 1000 + i, grammar=grammar)  # fmt: skip
        engine.add_request(f"{seed}-{i}", params=params, prompt_token_ids=prompt)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()


def timed_step(engine: LLMEngine, batch: int) -> tuple[float, float]:
    engine.step()
    assert engine.last_step.num_seqs == batch + 1, "a request finished early"
    return engine.last_step.total, engine.last_step.sample


def stop(engine: LLMEngine) -> None:
    for rid in list(engine._children):
        engine.abort_request(rid)


def measure(path, batch: int, steps: int, runs: int) -> dict:
    """Interleaved step pairs of the baseline and the constrained engine."""
    max_tokens = WARMUP_STEPS + steps + 8
    base, cons = make_engine(path, batch, max_tokens), make_engine(path, batch, max_tokens)
    pairs: list[dict[str, float]] = []
    for run in range(runs):
        start(base, batch, max_tokens, False, seed=run)
        start(cons, batch, max_tokens, True, seed=run)
        for k in range(WARMUP_STEPS + steps):
            first_base = k % 2 == 0  # alternate which engine goes first in the pair
            if first_base:
                b, c = timed_step(base, batch), timed_step(cons, batch)
            else:
                c, b = timed_step(cons, batch), timed_step(base, batch)
            if k >= WARMUP_STEPS:
                pairs.append({"base_s": b[0], "cons_s": c[0], "base_sample_s": b[1], "cons_sample_s": c[1]})
        stop(base)
        stop(cons)
    ratios = sorted(p["cons_s"] / p["base_s"] for p in pairs)
    q1, med, q3 = statistics.quantiles(ratios, n=4)
    out = {
        "vocab_size": base.model_config.vocab_size, "pairs": len(pairs), "ratios_q1_median_q3": [q1, med, q3],
        "median_ratio": med,
        "base_step_ms": statistics.median(p["base_s"] for p in pairs) * 1e3,
        "cons_step_ms": statistics.median(p["cons_s"] for p in pairs) * 1e3,
        "base_sample_ms": statistics.median(p["base_sample_s"] for p in pairs) * 1e3,
        "cons_sample_ms": statistics.median(p["cons_sample_s"] for p in pairs) * 1e3,
        "ratios": [round(r, 4) for r in ratios],  # sorted, one per step pair
    }  # fmt: skip
    out["sampler_only"] = sampler_cost(base.tokenizer, base.model_config.vocab_size, base.eos_token_ids, batch)
    return out


def sampler_cost(tokenizer, vocab: int, eos: list[int], batch: int, iters: int = 100) -> dict:
    """Median time of one batched sample() over batch + 1 rows, without and with one constrained
    row (its matcher mid-way through the schema), interleaved."""
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    spec = GrammarSpec.json_schema(SCHEMA)
    grammar = RequestGrammar(compiler.compile(spec), compiler.token_bans(spec))
    for t in tokenizer('{"people": [{"name": "Ann', add_special_tokens=False)["input_ids"]:
        assert grammar.accept(t)
    sampler = Sampler("cpu", seed=0)
    logits = torch.randn(batch + 1, vocab, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=100)
    plain = [sampler.new_state(params, [5]) for _ in range(batch + 1)]
    mixed = plain[:batch] + [sampler.new_state(params, [5], grammar=grammar)]
    times: dict[str, list[float]] = {"plain": [], "mixed": []}
    for _ in range(iters):
        for name, states in (("plain", plain), ("mixed", mixed)):
            t0 = time.perf_counter()
            sampler.sample(logits, states)
            times[name].append(time.perf_counter() - t0)
    plain_ms, mixed_ms = (statistics.median(times[k]) * 1e3 for k in ("plain", "mixed"))
    compiler.close()
    return {"plain_ms": plain_ms, "with_grammar_ms": mixed_ms, "added_ms": mixed_ms - plain_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--batch", type=int, default=16, help="unconstrained requests beside the one under test")
    ap.add_argument("--steps", type=int, default=60, help="timed decode step pairs per run")
    ap.add_argument("--runs", type=int, default=2, help="runs (fresh prompts) per model")
    args = ap.parse_args()
    torch.set_num_threads(2)
    results = {}
    for name in args.models:
        results[model_label(name)] = measure(bench_model(name), args.batch, args.steps, args.runs)
    rows = [[m, r["vocab_size"], r["pairs"], r["base_step_ms"], r["cons_step_ms"],
             f"{r['median_ratio']:.3f}x ({r['ratios_q1_median_q3'][0]:.3f}-{r['ratios_q1_median_q3'][2]:.3f})",
             f"{(r['median_ratio'] - 1) * 100:+.1f}%"] for m, r in results.items()]  # fmt: skip
    step_table = print_table(
        f"One json_schema request in a batch of {args.batch + 1}: the unconstrained requests' step time (CPU, "
        f"two engines stepped alternately, {args.runs} runs x {args.steps} step pairs, medians)",
        ["model", "vocab", "pairs", f"{args.batch + 1} unconstrained ms", f"{args.batch} + 1 json_schema ms",
         "ratio (quartiles)", "slowdown"], rows)  # fmt: skip
    sampler_table = print_table(
        f"Sampler only: one batched sample() of {args.batch + 1} rows, medians of 100",
        ["model", "no grammar ms", "1 json_schema row ms", "added ms", "added / step"],
        [[m, r["sampler_only"]["plain_ms"], r["sampler_only"]["with_grammar_ms"], r["sampler_only"]["added_ms"],
          f"{r['sampler_only']['added_ms'] / r['base_step_ms'] * 100:.1f}%"] for m, r in results.items()])  # fmt: skip
    write_result("structured_batch", {
        "batch": args.batch + 1, "steps": args.steps, "runs": args.runs, "models": results,
        "target": "an unconstrained request in the same batch is not slowed by more than 10% (issue 12)",
        "table": step_table + "\n\n" + sampler_table.replace("## ", "### ", 1),
    })  # fmt: skip


if __name__ == "__main__":
    main()
