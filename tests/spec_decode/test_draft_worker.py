"""DraftWorker: incremental context with rollback, capacity statuses, leases, and the engine
speculating with it in-process (greedy parity, acceptance, exact sampling, no leaks)."""

from __future__ import annotations

from collections import Counter

import torch
from scipy.stats import chisquare

from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.sampling.params import SamplingParams
from common.spec_decode.draft_worker import (DraftSampling, DraftStatus, DraftUpdate, DraftWorker, DraftWorkerConfig,
                                             DraftWorkerProposer)  # fmt: skip
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_greedy, random_prompts
from common.spec_decode.truncated_draft import make_truncated_draft
from tests.engine.engine_helpers import _hf_model

VOCAB = 1024


def make_worker(model, num_kv_blocks: int = 64, **kw) -> DraftWorker:
    return DraftWorker(DraftWorkerConfig(str(model), dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, **kw))


def spec_engine(model, proposer, k: int = 4, num_blocks: int = 256, adaptive: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu",
                                  cache=CacheConfig(num_kv_blocks=num_blocks),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
                                  speculative=SpeculativeConfig("draft", k, adaptive)), detokenize=False, proposer=proposer)  # fmt: skip


def at_baseline(worker: DraftWorker) -> bool:
    worker.check_integrity()
    return worker.num_sequences == 0 and worker.kv.num_free_blocks == worker.kv.num_blocks


def upd(rid, tokens, ctx, k, reset=False, accepted=0) -> DraftUpdate:
    return DraftUpdate(rid, 0, reset, accepted, tokens, ctx, k)


# -- the worker alone ---------------------------------------------------------------------------------
def test_incremental_rollback_equals_fresh_context(tiny_model):
    """After accepting some proposals and rejecting the rest, the proposals equal those of a worker
    that saw the same context from scratch (so the rolled-back K/V is exactly right)."""
    w, fresh = make_worker(tiny_model), make_worker(tiny_model)
    prompt = random_prompts([21], VOCAB, seed=3)[0]
    first = w.propose([upd("a", prompt, len(prompt), 5, reset=True)])[0]
    assert first.status is DraftStatus.OK and len(first.token_ids) == 5
    for accepted in (2, 0, 5):
        pending = w.propose([])  # no-op call: nothing changes
        assert pending == []
        ctx = prompt + first.token_ids[:accepted] + [7]
        res = w.propose([upd("a", [7], len(ctx), 4, accepted=accepted)])[0]
        ref = fresh.propose([upd("a", ctx, len(ctx), 4, reset=True)])[0]
        assert res.status is DraftStatus.OK and res.token_ids == ref.token_ids
        assert res.num_context_tokens == len(ctx)
        w.check_integrity()
        prompt, first = ctx, res
    w.release([("a", 0)])
    fresh.release(request_ids=["a"])
    assert at_baseline(w) and at_baseline(fresh)


def test_statuses_reset_capacity_and_lease(tiny_model):
    w = make_worker(tiny_model, num_kv_blocks=4, lease_s=10.0)  # 4 blocks of 16 tokens
    assert w.propose([upd("x", [5], 1, 2)])[0].status is DraftStatus.NEEDS_RESET  # unknown sequence
    ok = w.propose([upd("a", list(range(8, 40)), 32, 3, reset=True)])[0]
    assert ok.status is DraftStatus.OK
    # Context length disagrees with decode's: NEEDS_RESET, and the state is dropped.
    assert w.propose([upd("a", [9], 99, 3, accepted=1)])[0].status is DraftStatus.NEEDS_RESET
    assert at_baseline(w)
    # A context larger than the pool: NO_CAPACITY, nothing kept; a smaller one still fits after.
    big, small = upd("big", list(range(8, 108)), 100, 3, reset=True), upd("s", [8, 9, 10], 3, 2, reset=True)
    statuses = [r.status for r in w.propose([big, small])]
    assert statuses == [DraftStatus.NO_CAPACITY, DraftStatus.OK]
    w.check_integrity()
    assert w.expire_idle() == 0
    import time

    assert w.expire_idle(now=time.monotonic() + 11.0) == 1  # the lease frees what decode never released
    assert at_baseline(w)


def test_sampled_rows_return_the_distribution_they_were_drawn_from(tiny_model):
    w = make_worker(tiny_model)
    prompt = random_prompts([12], VOCAB, seed=5)[0]
    u = DraftUpdate("s", 0, True, 0, prompt, len(prompt), 3, DraftSampling(temperature=0.8, top_k=20, seed=11))
    a = w.propose([u], prob_dtype=torch.float16)[0]
    assert a.probs is not None and a.probs.shape == (3, VOCAB)
    assert torch.equal(a.probs, a.probs.half().float())  # exactly the wire values
    assert all(a.probs[j, t] > 0 for j, t in enumerate(a.token_ids))
    assert all(int((row > 0).sum()) <= 20 for row in a.probs)  # top_k applied
    b = w.propose([u], prob_dtype=torch.float16)[0]  # a retried step (same seed, same positions)
    assert a.token_ids == b.token_ids
    w.release(request_ids=["s"])
    assert at_baseline(w)


# -- the engine speculating with it ------------------------------------------------------------------
def test_engine_greedy_parity_mixed_batch_and_no_leaks(model_factory):
    target, draft = model_factory("qwen2", 0), model_factory("qwen2", 1)
    prompts = random_prompts([5, 19, 33, 50], VOCAB, seed=2)
    ref = hf_greedy(target, prompts, 14)
    for draft_model in (draft, target):
        worker = make_worker(draft_model, num_kv_blocks=128)
        engine = spec_engine(target, DraftWorkerProposer(worker))
        outs = engine.generate(prompts, [greedy(14)] * 3 + [greedy(14, logprobs=2)])
        assert [o[0].token_ids for o in outs] == ref
        if draft_model == target:
            assert engine.spec_stats.acceptance_rate >= 0.95
        assert_no_leaks(engine)
        assert at_baseline(worker)
    # Abort mid-run: both pools back to baseline.
    worker = make_worker(draft, num_kv_blocks=128)
    engine = spec_engine(target, DraftWorkerProposer(worker))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", params=greedy(30), prompt_token_ids=p)
    for _ in range(4):
        engine.step()
    for i in range(len(prompts)):
        engine.abort_request(f"r{i}")
    assert_no_leaks(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert at_baseline(worker)


def test_a_bf16_weight_draft_leaves_the_targets_greedy_output(model_factory):
    # A draft storing its matrices in bf16 (half the bytes a draft step streams) proposes from
    # slightly different logits; verification keeps the output the float32 target's.
    target = model_factory("qwen2", 0)
    prompts = random_prompts([5, 19, 33], VOCAB, seed=4)
    worker = make_worker(target, num_kv_blocks=128, weight_dtype="bfloat16")
    assert worker.model.weight_dtype == torch.bfloat16 and worker.kv_cache.storage.dtype == torch.float32
    engine = spec_engine(target, DraftWorkerProposer(worker))
    outs = engine.generate(prompts, [greedy(14)] * len(prompts))
    assert [o[0].token_ids for o in outs] == hf_greedy(target, prompts, 14)
    assert engine.spec_stats.acceptance_rate >= 0.8  # the same model, rounded: nearly always agrees
    assert_no_leaks(engine)
    assert at_baseline(worker)


def _processed(model, context: list[int], top_k: int) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(str(model))(torch.tensor([context])).logits[0, -1].float()
    kth = logits.topk(top_k).values[-1]
    return torch.softmax(logits.masked_fill(logits < kth, -float("inf")), dim=-1)


def test_sampling_distribution_is_the_targets_not_the_drafts(model_factory, tmp_path):
    """The first verified token (output 1) follows the target's distribution given output 0, with a
    draft (the target's first 3 of 4 layers) that agrees often but not always."""
    target = model_factory("llama", 0)
    draft = make_truncated_draft(target, 3, tmp_path / "draft")
    worker = make_worker(draft, num_kv_blocks=512)
    # Fixed k: at 250 sequences the measured cost would (rightly) turn speculation off on a CPU.
    engine = spec_engine(target, DraftWorkerProposer(worker), k=2, num_blocks=512, adaptive=False)
    prompt = random_prompts([6], VOCAB, seed=9)[0]
    params = SamplingParams(temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True)
    outs = []
    for batch in range(6):
        outs += [o[0].token_ids for o in engine.generate([prompt] * 250, params)]
    assert engine.spec_stats.num_draft_tokens >= len(outs)  # every second token went through verification
    rate = engine.spec_stats.acceptance_rate
    assert 0.05 < rate < 0.95, rate  # the draft disagrees often enough to exercise rejection
    counts = Counter(o[1] for o in outs)
    firsts = Counter(o[0] for o in outs)
    p_exp = sum(n * _processed(target, prompt + [t0], 6) for t0, n in firsts.items())
    q_exp = sum(n * _processed(draft, prompt + [t0], 6) for t0, n in firsts.items())
    support = sorted(set(counts) | set(torch.nonzero(p_exp > 0.5).flatten().tolist()))
    observed = [counts.get(t, 0) for t in support]
    assert sum(observed) == len(outs)  # nothing outside the target's top-k support
    expected_p = p_exp[support].double().numpy()
    assert chisquare(observed, expected_p * len(outs) / expected_p.sum()).pvalue > 1e-4
    q = q_exp[support].double().numpy() + 1e-3  # the draft's mass on the same tokens
    assert chisquare(observed, q * len(outs) / q.sum()).pvalue < 1e-8
    assert_no_leaks(engine)
    assert at_baseline(worker)
