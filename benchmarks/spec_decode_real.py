"""Speculative decoding with real drafts on real weights (tandem fetch-model's catalogue).

1. Draft model: Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft (same
   tokenizer) behind a real Draft gRPC server on loopback (the path `tandem up --draft-model`
   takes), at batch 1, 4 and 16, greedy and temperature 0.7, on chat-templated prompts of three
   kinds (code, prose, chat). Each row: decode tokens/s, speedup against the same engine without
   speculation (median over --reps runs, each paired with a baseline run beside it, alternating
   which runs first), measured acceptance rate and tokens per target pass. Greedy rows check the output is identical.
2. The same pair through `tandem up` itself (aggregated: decode + draft processes, its default
   one torch thread per service), against `tandem up` without the draft: batch 1, the code
   prompts, greedy, over the OpenAI API (what a user measures).
3. N-gram (prompt lookup) on SmolLM2-135M-Instruct for a prompt-copying task (quote a passage).

The draft runs as its own `tandem draft` process. By default it and the target take turns on
every core, as `tandem up` runs them on one box (decode waits for each Propose; no lookahead);
`--spec-threads 1 --draft-threads 1 --handback --lookahead` splits the cores instead (the draft
drafting ahead while the target verifies, as on a device of its own). One target engine serves
both arms: baseline requests are added with speculation off, so both share weights and warm-up;
the baseline runs with --threads torch threads (the whole machine), the speculating arm with
--spec-threads. Engines are measured warm (after one untimed run), as a
server runs. Adaptive k is on (the default), so where drafting cannot pay it should switch
itself off (speedup ~1.0, never far below).

    .venv/bin/python benchmarks/spec_decode_real.py [--quick] [--reps N] [--max-tokens N] [--lookahead]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

import grpc
import torch

from bench_common import ROOT, bench_model, print_table, timed_decode, write_result

from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams
from common.spec_decode.stats import SpecDecodeStats

K = 4
TARGET, DRAFT, SMALL = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"

PROMPTS: dict[str, list[str]] = {
    "code": [
        "Write a Python function that checks whether a string is a palindrome, with a docstring.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Write a JavaScript function that removes duplicate values from an array.",
        "Write a Python class Stack with push, pop and peek methods.",
    ],
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain in a paragraph why the sky is blue.",
        "Describe a busy market in a small town on a Saturday morning.",
        "Write a letter to a friend about a trip to the mountains.",
    ],
    "chat": [
        "Hi! How are you today?",
        "What should I cook for dinner tonight? I have rice, eggs and spinach.",
        "Can you recommend three books for a long train journey?",
        "What is the difference between a virus and a bacterium?",
    ],
}
PASSAGE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
    "it was the season of Darkness, it was the spring of hope, it was the winter of despair."
)
COPY_PROMPTS = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Quote the first two sentences of this passage exactly:\n\n{PASSAGE}",
]


def chat_ids(model, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)) for t in texts]  # fmt: skip


def engine_for(path, speculative: SpeculativeConfig | None = None, proposer=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=1024),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
                                  speculative=speculative or SpeculativeConfig()),
                     detokenize=False, proposer=proposer)  # fmt: skip


class DraftProcess:
    """`tandem draft` as a process of its own on a free loopback port, with its own torch threads."""

    def __init__(self, model, threads: int, lookahead: bool, weight_dtype: str = "auto") -> None:
        from services.runtime.redis_server import find_free_port

        self.port = find_free_port()
        self.log = open(ROOT / "benchmarks" / "results" / "spec_decode_real.draft.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "draft", "--model", str(model), "--host", "127.0.0.1",
             "--grpc-port", str(self.port), "--device", "cpu", "--dtype", "float32", "--torch-threads", str(threads),
             "--lookahead" if lookahead else "--no-lookahead", "--weight-dtype", weight_dtype],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "REDIS_URL": ""},
        )  # fmt: skip
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        channel = grpc.insecure_channel(self.address)
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"draft worker did not start (see {self.log.name})")
        channel.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def proposer(self, target_path):
        from common.models.config import ModelConfig
        from services.decode.draft_client import DraftTargetInfo, RemoteDraftProposer

        info = DraftTargetInfo.of_model(str(target_path), ModelConfig.from_pretrained(target_path).vocab_size)
        # A generous deadline: this measures speculation, not timeouts (failures are counted).
        return RemoteDraftProposer(info, timeout_s=60.0, address=self.address)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run_decode(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
               speculative: bool, threads: int) -> tuple[float, list[list[int]]]:  # fmt: skip
    """Decode tokens/s with `threads` torch threads (see bench_common.timed_decode)."""
    torch.set_num_threads(threads)
    return timed_decode(engine, prompts, params, speculative)


def measure(engine: LLMEngine, prompts, params, reps: int, greedy: bool, threads: tuple[int, int]) -> dict:
    """Warm speculating runs, each paired with a baseline run beside it (the machine drifts)."""
    base_threads, spec_threads = threads
    run_decode(engine, prompts, params, True, spec_threads)  # untimed: a server is warm
    engine.spec_stats = SpecDecodeStats(K)
    base_runs, spec_runs, same = [], [], True
    reference = None
    for rep in range(reps):
        # Alternate which arm runs first (AB BA ...): the machine drifts within a pair too.
        arms = {spec: run_decode(engine, prompts, params, spec, spec_threads if spec else base_threads)
                for spec in ((False, True) if rep % 2 == 0 else (True, False))}  # fmt: skip
        (b_tps, b_out), (s_tps, s_out) = arms[False], arms[True]
        base_runs.append(b_tps)
        spec_runs.append(s_tps)
        reference = reference or b_out
        same = same and (s_out == b_out == reference if greedy else True)
    engine.check_integrity()
    stats = engine.spec_stats
    ratios = [s / b for s, b in zip(spec_runs, base_runs)]
    # With an even number of reps half the pairs run each order, so a drift within a pair cancels
    # in the geometric mean of the ratios (a crossover design); the median is kept beside it.
    return dict(base_tok_s=statistics.median(base_runs), spec_tok_s=statistics.median(spec_runs),
                speedup=statistics.median(ratios), speedup_geomean=statistics.geometric_mean(ratios),
                speedup_runs=[round(r, 3) for r in ratios],
                acceptance=stats.acceptance_rate, tokens_per_pass=stats.mean_accepted_length,
                drafted=stats.num_draft_tokens > 0,
                same_output=same if greedy else None)  # fmt: skip


def tandem_up_tok_s(target, draft, prompts: list[list[int]], max_tokens: int,
                    draft_weight_dtype: str = "auto") -> tuple[float, list[list[int]]]:  # fmt: skip
    """Output tokens/s of `tandem up` (aggregated) over HTTP, one request at a time, after a warm-up."""
    import httpx

    from services.launcher.cluster import start_cluster

    # torch_threads "auto", as `tandem up` does by default: without a draft decode takes both cores;
    # with one it gives a core to the draft only while drafts are in flight.
    opts = dict(mode="aggregated", http_port=0, grpc_port=0, startup_timeout_s=900, torch_threads="auto",
                extra_args=["--dtype", "float32", "--device", "cpu"])  # fmt: skip
    if draft is not None:
        opts.update(draft_model=str(draft), service_args={"decode": ["--num-speculative-tokens", str(K)],
                                                          "draft": ["--weight-dtype", draft_weight_dtype]})
    with start_cluster(target, **opts) as cluster:  # type: ignore[arg-type]
        def complete(p: list[int]) -> list[int]:
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            r = httpx.post(cluster.http_url + "/v1/completions", json=body, timeout=1800)
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        complete(prompts[0])  # warm-up (and adaptive k's first measurements)
        start = time.perf_counter()
        outs = [complete(p) for p in prompts]
        return sum(len(o) for o in outs) / (time.perf_counter() - start), outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 only, code and chat, greedy")
    ap.add_argument("--rows", nargs="+", default=None, metavar="BATCH:PROMPTS:TEMP",
                    help="only these rows, e.g. 16:code:0 16:prose:0.7 (default: the full plan)")
    ap.add_argument("--no-ngram", dest="ngram", action="store_false", help="skip the n-gram rows")
    ap.add_argument("--name", default="spec_decode_real", help="results file name (benchmarks/results/NAME.json)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the baseline (no speculation)")
    # Defaults: what `tandem up` does on one box: target and draft take turns on every core (decode
    # waits for each Propose), no lookahead (it would compete with the verification it waits on).
    ap.add_argument("--spec-threads", type=int, default=2, help="torch threads of the target while speculating")
    ap.add_argument("--draft-threads", type=int, default=2, help="torch threads of the draft process")
    ap.add_argument("--handback", action="store_true", help="the speculating target verifies on --spec-threads "
                    "and takes --threads back for steps without drafts (split cores: with --spec-threads 1 --draft-threads 1)")
    ap.add_argument("--lookahead", action="store_true", help="the draft drafts ahead while the target verifies "
                    "(right on a device of its own; on shared cores it competes with the verification)")
    ap.add_argument("--no-tandem-up", dest="tandem_up", action="store_false", help="skip the tandem up rows")
    ap.add_argument("--draft-weight-dtype", default="auto", choices=("auto", "bfloat16"),
                    help="the draft's weight storage (bfloat16: half the bytes per draft step, float32 math)")
    args = ap.parse_args()
    target, draft, small = bench_model(TARGET), bench_model(DRAFT), bench_model(SMALL)

    plan = [(1, kind, temp) for kind in ("code", "prose", "chat") for temp in (0.0, 0.7)]
    plan += [(4, "code", 0.0), (4, "prose", 0.7), (4, "chat", 0.0), (16, "code", 0.0), (16, "prose", 0.7)]
    if args.quick:
        plan = [(1, "code", 0.0), (1, "chat", 0.0)]
    if args.rows:
        plan = [(int(b), kind, float(t)) for b, kind, t in (row.split(":") for row in args.rows)]
    rows, results = [], []
    server = DraftProcess(draft, args.draft_threads, args.lookahead, args.draft_weight_dtype)
    try:
        remote = server.proposer(target)
        drafting_threads = args.spec_threads if args.handback else None
        spec = engine_for(target, SpeculativeConfig("draft", K, threads_while_drafting=drafting_threads), proposer=remote)
        # With the handback the speculating arm starts on --threads and drops to --spec-threads
        # only for steps that verify drafts (SpeculativeConfig.threads_while_drafting).
        spec_run_threads = args.threads if args.handback else args.spec_threads
        for batch, kind, temp in plan:
            texts = [PROMPTS[kind][i % len(PROMPTS[kind])] for i in range(batch)]
            prompts = chat_ids(target, texts)
            params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
                      for i in range(batch)]  # fmt: skip
            r = measure(spec, prompts, params, args.reps, greedy=temp == 0.0, threads=(args.threads, spec_run_threads))
            r["draft_call_failures"] = remote.num_failures
            results.append(dict(batch=batch, prompts=kind, temperature=temp, draft=DRAFT, level="service (gRPC)",
                                draft_weight_dtype=args.draft_weight_dtype, **r))
            rows.append([batch, kind, temp, r["base_tok_s"], r["spec_tok_s"], r["speedup"], r["speedup_geomean"],
                         r["acceptance"] if r["drafted"] else "no drafts", r["tokens_per_pass"],
                         "-" if r["same_output"] is None else r["same_output"]])  # fmt: skip
            print(results[-1], flush=True)
        remote.close()
        del spec
        gc.collect()  # the tandem up rows load the target again
    finally:
        server.close()
    table = print_table(
        f"Speculative decoding with a real draft: target {TARGET}, draft {DRAFT} as its own `tandem draft` "
        f"process (lookahead {'on' if args.lookahead else 'off'}, {args.draft_threads} thread), float32"
        + (" (the draft's weights stored in bf16)" if args.draft_weight_dtype == "bfloat16" else "") + f", k <= {K} "
        f"(adaptive), {args.max_tokens} output tokens; baseline {args.threads} threads, speculating target "
        f"{args.spec_threads} while drafting" + (f" and {args.threads} otherwise" if args.handback else "") + f"; speedup: median over {args.reps} runs of the ratio to a baseline run beside each (alternating which runs first), geomean: their geometric mean; 'no drafts': adaptive k never started drafting in the row, so both arms ran plain steps",
        ["batch", "prompts", "temperature", "no spec tok/s", "spec tok/s", "speedup", "geomean", "acceptance",
         "tokens/pass", "same output"], rows)  # fmt: skip

    up_table, up_results = "", {}
    if args.tandem_up:
        code = chat_ids(target, PROMPTS["code"][:3])
        plain, plain_out = tandem_up_tok_s(target, None, code, args.max_tokens)
        spec_tps, spec_out = tandem_up_tok_s(target, draft, code, args.max_tokens, args.draft_weight_dtype)
        up_results = dict(prompts="code x3", max_tokens=args.max_tokens, no_draft_tok_s=plain, draft_tok_s=spec_tps,
                          speedup=spec_tps / plain, same_output=plain_out == spec_out)  # fmt: skip
        print(up_results, flush=True)
        up_table = print_table(
            f"tandem up (aggregated, default threads) with and without --draft-model {DRAFT}: target {TARGET}, "
            f"3 code prompts x {args.max_tokens} greedy tokens over /v1/completions, one at a time",
            ["no draft tok/s", "with draft tok/s", "speedup", "same output"],
            [[plain, spec_tps, spec_tps / plain, plain_out == spec_out]])  # fmt: skip

    # N-gram (prompt lookup) on a copying task: the answer repeats the prompt, so lookups hit.
    ngram_rows, ngram_results, ngram_table = [], [], ""
    if args.ngram:
        ngram = engine_for(small, SpeculativeConfig("ngram", K))
        for batch in (1, 4):
            prompts = chat_ids(small, [COPY_PROMPTS[i % len(COPY_PROMPTS)] for i in range(batch)])
            params = [SamplingParams(temperature=0.0, max_tokens=64) for _ in range(batch)]
            r = measure(ngram, prompts, params, max(args.reps, 3), greedy=True, threads=(args.threads, args.threads))
            ngram_results.append(dict(batch=batch, model=SMALL, task="copy a passage", **r))
            ngram_rows.append([batch, r["base_tok_s"], r["spec_tok_s"], r["speedup"], r["acceptance"],
                               r["tokens_per_pass"], r["same_output"]])  # fmt: skip
            print(ngram_results[-1], flush=True)
        ngram_table = print_table(
            f"N-gram speculation (prompt lookup, k <= {K}) on {SMALL}, greedy, a prompt-copying task (quote a passage)",
            ["batch", "no spec tok/s", "ngram tok/s", "speedup", "acceptance", "tokens/pass", "same output"], ngram_rows)
    path = write_result(args.name, dict(
        target=TARGET, draft=DRAFT, num_speculative_tokens=K, max_tokens=args.max_tokens, reps=args.reps,
        lookahead=args.lookahead, threads=dict(baseline=args.threads, speculating_target=args.spec_threads,
                                               draft=args.draft_threads, handback=args.handback),
        results=results, tandem_up=up_results, ngram=ngram_results,
        table="\n\n".join(t for t in (table, up_table, ngram_table) if t),
        targets={"batch 1 code speedup": ">= 1.6", "every row": ">= 0.95"}))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
