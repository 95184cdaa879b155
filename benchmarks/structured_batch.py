"""Does one grammar-constrained request slow the unconstrained ones in its batch?

B unconstrained sampled requests decode together with one more request that is either
unconstrained too (baseline) or constrained by a JSON schema that cannot complete within the
run (so it stays constrained every step). The unconstrained requests' inter-token latency is the
engine's step time; we report the mean decode step time of each setting (and its sampler share),
alternating baseline and constrained runs and taking the median ratio. On a shared CPU the step
times are noisy, so the sampler alone is also timed (same logits, many interleaved iterations):
the grammar's whole cost to the batch is what it adds there, measured at the tiny model's vocabulary
and at a real one's (--vocab-model, e.g. SmolLM2's 49152 tokens).

    python benchmarks/structured_batch.py [--size small] [--batch 16] [--steps 40] [--runs 3]
                                          [--vocab-model DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from bench_common import model_dir, print_table, write_result
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


def run_once(engine: LLMEngine, batch: int, steps: int, constrained: bool, seed: int) -> dict:
    rng = random.Random(seed)
    for i in range(batch + 1):
        prompt = [rng.randrange(8, 1000) for _ in range(rng.randint(32, 128))]
        grammar = GrammarSpec.json_schema(SCHEMA) if constrained and i == batch else None
        params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=steps + 40, ignore_eos=grammar is None,
                                seed=seed * 1000 + i, grammar=grammar)  # fmt: skip
        engine.add_request(f"{seed}-{constrained}-{i}", params=params, prompt_token_ids=prompt)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    total = sample = 0.0
    for _ in range(steps):
        engine.step()
        assert engine.last_step.num_seqs == batch + 1, "a request finished early"
        total += engine.last_step.total
        sample += engine.last_step.sample
    for rid in list(engine._children):
        engine.abort_request(rid)
    return {"step_ms": total / steps * 1e3, "sample_ms": sample / steps * 1e3}


def sampler_cost(tokenizer, vocab: int, eos: list[int], batch: int, iters: int) -> dict:
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
    return {"vocab_size": vocab, "plain_ms": plain_ms, "with_grammar_ms": mixed_ms, "added_ms": mixed_ms - plain_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small")
    ap.add_argument("--batch", type=int, default=16, help="unconstrained requests beside the one under test")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vocab-model", default=str(Path.home() / ".cache/tandem/models/smollm2-135m-instruct"),
                    help="a model folder whose tokenizer/vocabulary the sampler-only timing also uses")
    ap.add_argument("--sampler-iters", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(
        model=str(model_dir("llama", args.size)), dtype="float32", device="cpu",
        cache=CacheConfig(num_kv_blocks=(args.batch + 1) * 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=args.batch + 1),
    ), detokenize=True)  # fmt: skip
    engine.grammar_compiler.compile(GrammarSpec.json_schema(SCHEMA))  # compile outside the timing
    run_once(engine, args.batch, 5, True, seed=99)  # warm-up, untimed
    base, cons, ratios = [], [], []
    for r in range(args.runs):  # alternate which setting goes first, so drifting load favours neither
        if r % 2:
            c = run_once(engine, args.batch, args.steps, True, seed=r)
            b = run_once(engine, args.batch, args.steps, False, seed=r)
        else:
            b = run_once(engine, args.batch, args.steps, False, seed=r)
            c = run_once(engine, args.batch, args.steps, True, seed=r)
        base.append(b)
        cons.append(c)
        ratios.append(c["step_ms"] / b["step_ms"])
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    rows = [
        [f"{args.batch + 1} unconstrained", med(base, "step_ms"), med(base, "sample_ms"), "-"],
        [f"{args.batch} unconstrained + 1 json_schema", med(cons, "step_ms"), med(cons, "sample_ms"),
         f"{(statistics.median(ratios) - 1) * 100:+.1f}%"],
    ]  # fmt: skip
    step_table = print_table(f"One constrained request in a batch of {args.batch + 1} (llama-{args.size}, CPU, "
                f"{args.steps} decode steps x {args.runs} runs, medians)",
                ["batch", "step ms", "sampler ms", "unconstrained slowdown"], rows)  # fmt: skip
    samplers = [sampler_cost(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids,
                             args.batch, args.sampler_iters)]  # fmt: skip
    if Path(args.vocab_model, "config.json").is_file():
        from transformers import AutoConfig, AutoTokenizer

        cfg = AutoConfig.from_pretrained(args.vocab_model)
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
        samplers.append(sampler_cost(AutoTokenizer.from_pretrained(args.vocab_model), cfg.vocab_size, eos,
                                     args.batch, args.sampler_iters))  # fmt: skip
    step_ms = med(base, "step_ms")
    sampler_table = print_table(f"Sampler only: one batched sample() of {args.batch + 1} rows, medians of {args.sampler_iters}",
                ["vocab", "no grammar ms", "1 json_schema row ms", "added ms", f"added / step ({step_ms:.0f} ms)"],
                [[r["vocab_size"], r["plain_ms"], r["with_grammar_ms"], r["added_ms"],
                  f"{r['added_ms'] / step_ms * 100:.2f}%"] for r in samplers])  # fmt: skip
    write_result("structured_batch", {
        "model": f"llama-{args.size}", "vocab_size": engine.model_config.vocab_size, "batch": args.batch + 1,
        "steps": args.steps, "runs": args.runs, "baseline": base, "constrained": cons, "ratios": ratios,
        "median_slowdown": statistics.median(ratios) - 1, "sampler_only": samplers,
        "target": "an unconstrained request in the same batch is not slowed by more than 10% (issue 12)",
        "table": step_table + "\n\n" + sampler_table.replace("## ", "### ", 1),
    })  # fmt: skip


if __name__ == "__main__":
    main()
