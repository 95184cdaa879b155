"""Speculative decoding: decode tokens/s with and without a draft, at batch 1, 4 and 16.

Target: llama `small` (~100M). Drafts:
  * `tiny`      : llama tiny (~1M, same tokenizer), a much smaller real draft. Random weights
                  agree with the target almost never, so this row shows the overhead side.
  * `trunc-1`   : the target's first layer + its embeddings/head (a real truncated draft).
  * `mix-p`     : the trunc-1 draft model runs for real (its forward passes, KV, rollback), but
                  each proposed token is replaced by the target's own greedy token with
                  probability p: a draft of controlled quality, to chart speedup against the
                  acceptance rate (random-weight drafts, truncated or not, score ~0 here).
Engine-level (the DraftWorker in-process as the proposer, no gRPC), plus service-level rows
over a real Draft gRPC server on loopback, at every batch size. Greedy, so every run's output is
checked equal to the baseline's. Every row states its measured acceptance rate. Engines are
measured warm, as a server runs; each row also gives a fresh engine's first ("cold") run.

    .venv/bin/python benchmarks/spec_decode.py [--quick] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading

import torch

from bench_common import make_workload, model_dir, print_table, timed_decode, write_result

from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.spec_decode.draft_worker import DraftWorker, DraftWorkerConfig, DraftWorkerProposer
from common.spec_decode.proposer import Proposal, ProposalRequest
from common.spec_decode.stats import SpecDecodeStats
from common.spec_decode.truncated_draft import make_truncated_draft
from common.sampling.params import SamplingParams

K = 4


class AgreementMix:
    """Wraps a real proposer: pays its cost, then swaps each token for the target's with prob p."""

    def __init__(self, inner, oracle: dict[tuple[int, ...], list[int]], p: float, seed: int = 0) -> None:
        self.inner, self.oracle, self.p = inner, oracle, p
        self.rng = random.Random(seed)

    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        got = self.inner.propose(requests)
        for r in requests:
            prop = got.get(r.request_id)
            if prop is None:
                continue
            for prompt, out in self.oracle.items():
                if tuple(r.token_ids[: len(prompt)]) == prompt:
                    done = len(r.token_ids) - len(prompt)
                    truth = out[done : done + len(prop.token_ids)]
                    prop.token_ids = [t if j < len(truth) and self.rng.random() < self.p else d
                                      for j, (d, t) in enumerate(zip(prop.token_ids, truth + [None] * K))]  # fmt: skip
                    break
        return got

    def release(self, request_ids: list[str]) -> None:
        self.inner.release(request_ids)


def target_engine(path, proposer=None) -> LLMEngine:
    spec = SpeculativeConfig("draft", K) if proposer is not None else SpeculativeConfig()
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=512),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=64),
                                  speculative=spec), detokenize=False, proposer=proposer)  # fmt: skip


def run_decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s: output tokens after the first (which the prefill step samples) / their time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return timed_decode(engine, prompts, [params] * len(prompts))


def draft_worker(path) -> DraftWorker:
    return DraftWorker(DraftWorkerConfig(str(path), dtype="float32", device="cpu", num_kv_blocks=512, max_num_seqs=64))


class DraftServer:
    """A real Draft gRPC server on its own loop thread (service-level rows)."""

    def __init__(self, path) -> None:
        from services.draft.server import serve
        from services.runtime.settings import CommonSettings, DraftSettings, EngineSettings
        from tests.services.decode_helpers import free_port

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        settings = DraftSettings(CommonSettings(model=str(path), host="127.0.0.1", grpc_port=free_port()),
                                 EngineSettings(device="cpu", dtype="float32", num_kv_blocks=512))  # fmt: skip
        self.handle = asyncio.run_coroutine_threadsafe(serve(settings), self.loop).result(120)

    def proposer(self, target_path):
        from common.models.config import ModelConfig
        from services.decode.draft_client import DraftTargetInfo, RemoteDraftProposer

        info = DraftTargetInfo.of_model(str(target_path), ModelConfig.from_pretrained(target_path).vocab_size)
        return RemoteDraftProposer(info, timeout_s=2.0, address=self.handle.address)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.handle.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="batch 1 and 4 only, fewer tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="warm runs per row, each paired with a baseline run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [1, 4] if args.quick else [1, 4, 16]
    max_tokens = 16 if args.quick else 64
    target = model_dir("llama", "small")
    tiny = model_dir("llama", "tiny")
    trunc = make_truncated_draft(target, 1, target.parent / "llama-small-0-trunc1")
    mixes = [0.5, 0.7, 0.8, 0.9, 1.0]

    rows, results = [], []

    def record(batch, draft, level, tps, speedups, rate, mean_len, same, cold=None, at=None):
        speedup = statistics.median(speedups)
        at = len(results) if at is None else at
        results.insert(at, dict(batch=batch, draft=draft, level=level, tokens_per_s=round(tps, 2), speedup=round(speedup, 3),
                            speedup_runs=[round(x, 3) for x in speedups], cold_speedup=None if cold is None else round(cold, 3),
                            acceptance_rate=None if rate is None else round(rate, 3),
                            mean_accepted_len=None if mean_len is None else round(mean_len, 3), output_matches=same))  # fmt: skip
        rows.insert(at, [batch, draft, level, tps, speedup, "-" if cold is None else f"{cold:.2f}",
                     "-" if rate is None else f"{rate:.2f}", "-" if mean_len is None else f"{mean_len:.2f}", same])  # fmt: skip

    for batch in batches:
        work = make_workload(batch, (32, 32), (max_tokens, max_tokens), 1024, seed=batch)
        base_engine = target_engine(target)
        base_tps, base_out = run_decode(base_engine, work.prompts, max_tokens)
        base_runs = [base_tps]
        first_row = len(results)

        def paired_base() -> float:
            # A fresh baseline run right before each row: the machine's speed drifts by tens of
            # percent over minutes, so each speedup is taken against its neighbour in time.
            tps, out = run_decode(base_engine, work.prompts, max_tokens)
            assert out == base_out, "baseline output changed between runs"
            base_runs.append(tps)
            return tps

        def measured(engine: LLMEngine):
            """(median warm tokens/s, warm speedups, cold speedup, stats of the warm runs, outputs same).

            The baseline engine is warm (its first run above is untimed); so are the speculating
            engine's timed runs: a server is long-lived, and a fresh engine's first run pays
            one-off costs (first calls, adaptive k's cost model learning the machine) that the
            cold speedup shows separately. Warm runs alternate with baseline runs, and the
            speedup is the median of those pairs' ratios (single runs here are +-15% noisy)."""
            cold_base = paired_base()
            cold_tps, out = run_decode(engine, work.prompts, max_tokens)
            same = out == base_out
            engine.spec_stats = SpecDecodeStats(K)  # the warm runs' own counts
            runs, speedups = [], []
            for _ in range(args.reps):
                base = paired_base()
                tps, out = run_decode(engine, work.prompts, max_tokens)
                runs.append(tps)
                speedups.append(tps / base)
                same = same and out == base_out
            engine.check_integrity()
            return statistics.median(runs), speedups, cold_tps / cold_base, engine.spec_stats, same

        oracle = {tuple(p): o for p, o in zip(work.prompts, base_out)}
        configs = [("tiny", lambda: DraftWorkerProposer(draft_worker(tiny))),
                   ("trunc-1", lambda: DraftWorkerProposer(draft_worker(trunc)))]  # fmt: skip
        configs += [(f"mix-{p}", lambda p=p: AgreementMix(DraftWorkerProposer(draft_worker(trunc)), oracle, p)) for p in mixes]
        for name, make in configs:
            tps, speedups, cold, s, same = measured(target_engine(target, make()))
            record(batch, name, "engine", tps, speedups, s.acceptance_rate, s.mean_accepted_length, same, cold)
        # The same draft behind a real Draft gRPC server on loopback (its own loop thread).
        server = DraftServer(trunc)
        try:
            for name, p in (("trunc-1", None), ("mix-0.9", 0.9)):
                remote = server.proposer(target)
                proposer = remote if p is None else AgreementMix(remote, oracle, p)
                tps, speedups, cold, s, same = measured(target_engine(target, proposer))
                record(batch, name, "service (gRPC)", tps, speedups, s.acceptance_rate, s.mean_accepted_length,
                       same, cold)  # fmt: skip
                remote.close()
        finally:
            server.close()
        median_base = sorted(base_runs)[len(base_runs) // 2]
        record(batch, "none", "engine", median_base, [1.0], None, None, True, at=first_row)
        results[first_row]["baseline_runs_tokens_per_s"] = [round(b, 2) for b in base_runs]
    table = print_table(f"Speculative decoding, target llama small, k <= {K} (adaptive), greedy, {max_tokens} output tokens; "
                        f"warm engines (after one untimed run); speedup: median over {args.reps} runs of the ratio to a "
                        "baseline run just before each (baseline row: median of those runs); cold: a fresh engine's "
                        "first run against its own baseline run",
                ["batch", "draft", "level", "decode tok/s", "speedup", "cold speedup", "acceptance", "tokens/pass",
                 "same output"], rows)  # fmt: skip
    path = write_result("spec_decode", dict(
        target="llama small (~100M, float32, cpu)", drafts={
            "tiny": "llama tiny (~1M), same tokenizer", "trunc-1": "target's first layer + embeddings/head",
            "mix-p": "trunc-1 runs for real; each proposal replaced by the target's greedy token with probability p",
        }, num_speculative_tokens=K, max_tokens=max_tokens, prompt_len=32, reps=args.reps, results=results, table=table))  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
