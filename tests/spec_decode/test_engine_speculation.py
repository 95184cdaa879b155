"""Speculative decoding inside the engine: greedy output never changes, blocks never leak."""

from __future__ import annotations

import random

import pytest
import torch

from common.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.spec_decode.step_cost import StepCostModel
from common.sampling.params import SamplingParams
from common.spec_decode.proposer import Proposal, ProposalRequest
from tests.conftest import ARCHS
from tests.engine.engine_helpers import assert_no_leaks, greedy, hf_greedy, random_prompts

MAX_TOKENS = 12


class OracleProposer:
    """Proposes the known greedy continuation: every draft should be accepted."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.table = {tuple(p): o for p, o in zip(prompts, outputs)}
        self.released: list[str] = []

    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        out = {}
        for r in requests:
            for p, o in self.table.items():
                if tuple(r.token_ids[: len(p)]) == p:
                    done = len(r.token_ids) - len(p)
                    out[r.request_id] = Proposal(o[done : done + r.k])
        return out

    def release(self, request_ids):
        self.released.extend(request_ids)


class NoisyProposer:
    """Random drafts with a uniform draft distribution: mostly rejected."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.rng = random.Random(0)

    def propose(self, requests):
        return {
            r.request_id: Proposal(
                [self.rng.randrange(self.vocab) for _ in range(r.k)], torch.full((r.k, self.vocab), 1.0 / self.vocab)
            )
            for r in requests
        }

    def release(self, request_ids):
        pass


class FailingProposer:
    def propose(self, requests):
        raise ConnectionError("draft worker unreachable")

    def release(self, request_ids):
        pass


def spec_engine(path, proposer=None, method="draft", k=4, budget=64, num_blocks=512, adaptive=True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path), dtype="float32", device="cpu",
            cache=CacheConfig(num_kv_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64),
            speculative=SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=adaptive),
        ),
        proposer=proposer,
    )  # fmt: skip


@pytest.fixture(scope="module")
def case(model_factory):
    def get(arch):
        path = model_factory(arch)
        prompts = random_prompts([1, 9, 33, 70, 120], 1000, seed=11)
        return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_drafts_all_accepted_and_exact(case, arch):
    path, prompts, expected = case(arch)
    proposer = OracleProposer(prompts, expected)
    engine = spec_engine(path, proposer)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate >= 0.95
    assert stats.mean_accepted_length > 2
    assert sorted(set(proposer.released)) == sorted(f"gen-0-{i}" for i in range(len(prompts)))
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_noisy_drafts_change_nothing(case, arch):
    path, prompts, expected = case(arch)
    engine = spec_engine(path, NoisyProposer(1024), k=3, budget=16, num_blocks=40)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(engine)


def test_ngram_method_greedy_exact(case):
    path, prompts, expected = case("llama")
    engine = spec_engine(path, method="ngram", k=3)
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert_no_leaks(engine)


def test_failing_proposer_falls_back(case):
    path, prompts, expected = case("llama")
    engine = spec_engine(path, FailingProposer())
    outs = engine.generate(prompts, greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected
    assert_no_leaks(engine)


def test_opt_out_and_abort_mid_speculation(case):
    path, prompts, expected = case("llama")
    proposer = OracleProposer(prompts, expected)
    engine = spec_engine(path, proposer)
    engine.add_request("off", params=greedy(MAX_TOKENS), prompt_token_ids=prompts[2], speculative=False)
    engine.add_request("on", params=greedy(MAX_TOKENS), prompt_token_ids=prompts[3])
    for _ in range(3):
        engine.step()
    assert engine.abort_request("on")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.token_ids == expected[2]
    assert "on" in proposer.released
    assert_no_leaks(engine)


def test_sampled_speculation_runs_and_stops(case):
    path, prompts, _ = case("llama")
    engine = spec_engine(path, NoisyProposer(1024), k=3)
    params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert all(len(o[0].token_ids) == MAX_TOKENS for o in outs)
    assert_no_leaks(engine)


def test_engine_measures_the_cost_of_draft_tokens(model_factory):
    """With every request drafting the same k, the engine takes an occasional plain step so the
    cost model sees two step sizes; then a draft token has a measured price."""
    path = model_factory("llama")
    prompts = random_prompts([5, 8], 1000, seed=3)
    plain = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    expected = [o[0].token_ids for o in plain.generate(prompts, greedy(60))]
    engine = spec_engine(path, OracleProposer(prompts, expected), k=2)
    assert engine.spec_cost.draft_token_cost(2) is None  # nothing measured yet: the prior
    outs = engine.generate(prompts, greedy(60))
    assert [o[0].token_ids for o in outs] == expected
    fixed, per_token = engine.spec_cost.line()  # measured (its values are this machine's timings)
    assert fixed >= 0 and per_token >= 0 and fixed + per_token > 0
    assert engine.spec_cost.draft_s_per_position(2) is not None
    assert 0 < engine.spec_cost.draft_token_cost(2) <= engine.spec_cost.max_cost
    assert engine.spec_stats.acceptance_rate == 1.0
    assert_no_leaks(engine)


class AskRecorder:
    """Wraps a proposer and records the k each request asked for."""

    def __init__(self, inner) -> None:
        self.inner, self.asked, self.calls = inner, [], []

    def propose(self, requests):
        self.asked += [r.k for r in requests]
        self.calls.append([r.k for r in requests])
        return self.inner.propose(requests)

    def release(self, request_ids):
        self.inner.release(request_ids)


class _PriorCostOnly(StepCostModel):
    """A cost model that never measures: adaptive k prices draft tokens at its prior."""

    def should_explore(self) -> bool:
        return False

    def draft_token_cost(self, batch_size: int) -> float | None:
        return None

    def step_ratio(self, batch_size: int, draft_ks: list[int]) -> float | None:
        return None


def test_new_requests_start_from_the_engines_recent_acceptance(case):
    """A draft that is always rejected is not tried at full k by every new request (they probe,
    together), and one that is always right is used at full k from a new request's first step."""
    path, prompts, expected = case("llama")
    noisy = AskRecorder(NoisyProposer(1024))
    engine = spec_engine(path, noisy)
    # k here follows the prior and the acceptance rate alone: a draft token's measured price is a
    # wall-clock reading (on a loaded machine it swings between waves), and has tests of its own.
    engine.spec_cost = _PriorCostOnly()
    engine.generate(prompts, greedy(MAX_TOKENS))
    assert max(noisy.asked) >= 3 and engine.spec_prior.rate < 0.5  # the first requests drafted on the prior
    noisy.asked.clear()
    noisy.calls.clear()
    outs = engine.generate(prompts, greedy(40))
    assert [o[0].token_ids[:MAX_TOKENS] for o in outs] == expected
    # only probes, and all requests probe in the same steps: one batched draft call per probe
    assert len(noisy.calls) >= 2 and all(call == [1] * len(prompts) for call in noisy.calls), noisy.calls
    assert_no_leaks(engine)

    oracle = AskRecorder(OracleProposer(prompts, expected))
    engine = spec_engine(path, oracle)
    engine.spec_cost = _PriorCostOnly()
    engine.generate(prompts, greedy(MAX_TOKENS))
    assert engine.spec_prior.rate > 0.8  # from the prior 0.7, at which a new request drafts 3
    oracle.asked.clear()
    assert [o[0].token_ids for o in engine.generate(prompts[2:3], greedy(MAX_TOKENS))] == expected[2:3]
    assert oracle.asked[0] == 4


def test_drafting_steps_give_threads_up_and_plain_steps_take_them_back(case):
    path, prompts, expected = case("llama")
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = LLMEngine(
            EngineConfig(model=str(path), dtype="float32", device="cpu", cache=CacheConfig(num_kv_blocks=512),
                         scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=64),
                         speculative=SpeculativeConfig("draft", 4, adaptive=False, threads_while_drafting=1)),
            proposer=OracleProposer(prompts[:2], expected[:2]),
        )  # fmt: skip
        engine.add_request("a", prompt_token_ids=prompts[1], params=greedy(MAX_TOKENS))
        threads_by_kind: dict[bool, set[int]] = {True: set(), False: set()}
        while engine.has_unfinished_requests():
            drafted_before = engine.spec_stats.num_draft_tokens
            engine.step()
            threads_by_kind[engine.spec_stats.num_draft_tokens > drafted_before].add(torch.get_num_threads())
        assert threads_by_kind[True] == {1}  # verification passes ran on the drafting share
        assert threads_by_kind[False] == {2}  # the prompt's step kept the engine's own threads
        # A request that opts out of speculation decodes on the engine's 2 threads again.
        engine.add_request("b", prompt_token_ids=prompts[1], params=greedy(4))
        engine.scheduler.requests["b"].spec_enabled = False
        while engine.has_unfinished_requests():
            engine.step()
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_a_draft_catching_up_is_not_priced_as_drafting(case):
    """A new request's first call (its prompt) and a call after a pause (every token since it last
    drafted) make the draft catch up: the engine flags them and keeps them out of the draft-token
    price and the goodput governor."""
    path, prompts, expected = case("llama")
    engine = spec_engine(path, OracleProposer(prompts[:2], expected[:2]), k=1, adaptive=False)  # the pause is ours
    engine.add_request("a", prompt_token_ids=prompts[1], params=greedy(MAX_TOKENS))
    req = engine.scheduler.requests["a"]
    engine.step()  # the prompt
    engine.step()  # the first drafts: a new request's prompt ingested, neither priced nor counted
    assert engine.spec_stats.num_draft_tokens > 0 and engine.spec_catch_up
    assert engine.spec_cost.draft.w == 0 and engine.spec_governors.for_batch(1).spec_samples == 0
    engine.step()  # steady: priced and counted
    price, samples = engine.spec_cost.draft.w, engine.spec_governors.for_batch(1).spec_samples
    assert not engine.spec_catch_up and price > 0 and samples == 1
    req.spec_enabled = False
    engine.step()
    engine.step()  # two plain steps: the draft falls behind
    req.spec_enabled = True
    drafted = engine.spec_stats.num_draft_tokens
    engine.step()
    assert engine.spec_stats.num_draft_tokens > drafted and engine.spec_catch_up
    assert engine.spec_cost.draft.w == price and engine.spec_governors.for_batch(1).spec_samples == samples
    engine.step()  # drafting again the step after: steady, measured
    assert not engine.spec_catch_up and engine.spec_governors.for_batch(1).spec_samples == samples + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.spec_stats.acceptance_rate == 1.0
    assert_no_leaks(engine)


def stateful_oracle_engine(case, cost_model, **kw):
    """An engine whose draft keeps per-request state, as a draft model's KV does (a lapsed or
    late request would have to catch up), and proposes the known greedy continuation."""
    path, prompts, expected = case("llama")
    oracle = AskRecorder(OracleProposer(prompts, expected))
    oracle.keeps_state = True
    engine = spec_engine(path, oracle, **kw)
    engine.spec_cost = cost_model
    return engine, oracle, prompts, expected


def test_a_lapsed_request_is_not_resumed_with_a_stateful_draft(case):
    """With a draft that keeps per-request KV, a request that went two steps without drafts
    finishes plain (resuming would cost a catch-up prefill at the draft) and its draft state is
    released at once; other requests keep drafting. Outputs stay exact."""
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _PriorCostOnly(), k=1)
    engine.add_request("a", prompt_token_ids=prompts[1], params=greedy(MAX_TOKENS))
    engine.add_request("b", prompt_token_ids=prompts[2], params=greedy(MAX_TOKENS))
    while len(engine.scheduler.requests["a"].output_token_ids) < 3:
        engine.step()
    assert engine.spec_stats.num_draft_tokens > 0
    a = engine.scheduler.requests["a"]
    a.spec_enabled = False
    engine.step()
    engine.step()
    a.spec_enabled = True
    oracle.calls.clear()
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert "a" in oracle.inner.released  # freed when it lapsed (and again when it finished)
    assert oracle.calls and all(len(call) == 1 for call in oracle.calls)  # only "b" drafted after
    assert engine.spec_stats.acceptance_rate == 1.0
    assert_no_leaks(engine)


@pytest.mark.parametrize("ingest_s_per_token, starts", [(1e-5, True), (1.0, False)])
def test_a_request_that_never_drafted_starts_late_only_where_its_ingestion_pays(case, ingest_s_per_token, starts):
    """A request past its first steps that never drafted (held back: in a batch whose starts go
    one a step while the prices are unmeasured, the others waited; here, speculation off for its
    first steps) is still a start: its draft would ingest its whole context, which the start
    check prices against its remaining tokens, so it starts where that pays and stays plain
    where it cannot. Outputs are exact either way."""
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _FixedPrices(ingest_s_per_token), k=2)
    engine.add_request("c", prompt_token_ids=prompts[1], params=greedy(MAX_TOKENS))
    c = engine.scheduler.requests["c"]
    c.spec_enabled = False
    while len(c.output_token_ids) <= 3:  # past its first steps without a draft
        engine.step()
    c.spec_enabled = True
    while engine.has_unfinished_requests():
        engine.step()
    assert bool(oracle.calls) == starts
    if starts:
        assert engine.spec_stats.acceptance_rate == 1.0
    assert c.output_token_ids == expected[1]
    assert_no_leaks(engine)


class _FixedPrices(StepCostModel):
    """Measured prices, fixed: a draft token at 0.1 of a 50 ms share, ingestion as given."""

    def __init__(self, ingest_s_per_token: float) -> None:
        super().__init__()
        self.fixed_ingest = ingest_s_per_token

    def should_explore(self) -> bool:
        return False

    def draft_token_cost(self, batch_size: int) -> float | None:
        return 0.1

    def step_share(self, batch_size: int) -> float | None:
        return 0.05

    def step_ratio(self, batch_size: int, draft_ks: list[int]) -> float | None:
        return 1.0 + 0.1 * sum(draft_ks) / batch_size

    def ingest_cost(self, num_tokens: int) -> float | None:
        return self.fixed_ingest * num_tokens


@pytest.mark.parametrize("ingest_s_per_token, started", [(1e-5, 4), (1.0, 0)])
def test_new_requests_of_a_batch_start_drafting_together_when_worth_their_ingestion(case, ingest_s_per_token, started):
    """With a stateful draft and measured prices, the young requests of a batch start together,
    in one draft call (drafting for one of them cannot show what drafting for all delivers), or
    not at all when the expected saving is less than the draft's ingestion of their prompts."""
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _FixedPrices(ingest_s_per_token), budget=512)
    outs = engine.generate(prompts[1:], greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected[1:]
    if started:
        assert len(oracle.calls[0]) == started and engine.spec_stats.acceptance_rate == 1.0
    else:
        assert oracle.calls == []
    assert_no_leaks(engine)


def test_new_requests_start_one_a_step_while_the_prices_are_unmeasured(case):
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _PriorCostOnly(), budget=512)
    outs = engine.generate(prompts[1:], greedy(MAX_TOKENS))
    assert [o[0].token_ids for o in outs] == expected[1:]
    assert [len(c) for c in oracle.calls[:3]] == [1, 2, 3]  # one new start a step, and none ages out
    assert_no_leaks(engine)


@pytest.mark.parametrize("ingest_s_per_token, starts", [(1e-5, True), (1.0, False)])
def test_a_start_check_resting_on_an_earlier_workload_cannot_lock_drafting_out(case, ingest_s_per_token, starts):
    """The start check judges a new request by what earlier ones measured (calibration, prior).
    Where that says no, nothing drafts, so nothing would ever refresh it: the governor's burst
    comes due and the next new request is judged as a new workload's would be, so it starts,
    is measured, and drafts exactly; unless even then it could not win back the draft's
    ingestion of its prompt (measured, not stale), which no burst overrides."""
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _FixedPrices(ingest_s_per_token))
    governor = engine.spec_governors.for_batch(1)
    governor.burst_wait = 10_000  # no burst while the first request runs
    for _ in range(governor.min_samples):  # the last workload: drafting delivered 1/5 of its prediction
        governor.observe(drafted=False, tokens=1, sequences=1, seconds=0.1)
        governor.observe(drafted=True, tokens=1, sequences=1, seconds=0.1, predicted=5.0)
    assert governor.drafting_pays is True and governor.calibrated(2.0) < 1.0
    first = engine.generate(prompts[1:2], greedy(MAX_TOKENS))
    assert oracle.calls == [] and first[0][0].token_ids == expected[1]  # refused: the check said no
    assert not governor.exploring and governor._since_drafted >= 4
    governor.burst_wait = 4  # nothing drafted for that long: the next decision's burst is due
    second = engine.generate(prompts[2:3], greedy(MAX_TOKENS))
    assert second[0][0].token_ids == expected[2]
    if not starts:
        assert oracle.calls == [] and governor.exploring
        assert_no_leaks(engine)
        return
    assert oracle.calls and oracle.calls[0] == [engine.config.speculative.num_speculative_tokens]
    assert engine.spec_stats.acceptance_rate == 1.0 and governor.spec_samples > governor.min_samples
    assert_no_leaks(engine)


@pytest.mark.parametrize("other_speculates", [True, False])
def test_no_request_is_made_slower_by_the_others_drafting(case, other_speculates):
    """A drafting step takes longer for the whole batch; a request that does not draft (here
    speculation is off for it; a lapsed or low-acceptance one is the same) gains nothing from
    it. With the price fixed at 0.1 of a share a draft token, one request drafting 4 for a
    batch of two makes the step 1.2x: the other would run at 0.83x its plain rate, so the
    engine caps k where the step leaves it within SLOWDOWN_MARGIN (0.95x): one token, 1.05x.
    Where both draft, both gain, and they draft together at full k."""
    engine, oracle, prompts, expected = stateful_oracle_engine(case, _FixedPrices(1e-5), budget=512)
    engine.add_request("a", prompt_token_ids=prompts[1], params=greedy(MAX_TOKENS))
    engine.add_request("b", prompt_token_ids=prompts[2], params=greedy(MAX_TOKENS), speculative=other_speculates)
    outputs: dict[str, list[int]] = {}
    calls_beside_b = []  # draft calls while b was still decoding
    while engine.has_unfinished_requests():
        before = len(oracle.calls)
        b_running = "b" in engine.scheduler.requests
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if b_running and len(oracle.calls) > before:
            calls_beside_b.append(oracle.calls[-1])
    assert [outputs["a"], outputs["b"]] == expected[1:3]
    if other_speculates:
        assert calls_beside_b and len(calls_beside_b[0]) == 2 and engine.spec_stats.acceptance_rate == 1.0
        assert max(max(c) for c in calls_beside_b) > 1
    else:
        # a drafts one token at a time: a step of 1.05x leaves b within the 5% margin
        assert calls_beside_b and all(c == [1] for c in calls_beside_b)
    assert_no_leaks(engine)


@pytest.mark.parametrize("low_rate, cap", [(0.06, 0), (0.5, 4)])
def test_a_drafting_request_is_not_let_lose_by_drafting(case, low_rate, cap):
    """A request that drafts is held to its full plain rate (DRAFTER_MARGIN), not to the 0.95
    allowance of one that does not draft. Beside a request that accepts everything, one whose
    drafts are accepted at 0.06 would get 1.06 tokens from a k = 1 step that takes 1.1x a plain
    one (the fixed prices): 0.96x its plain rate, inside 0.95 but a loss, so the step is plain.
    At 0.5 it gains at full k (1.94 tokens in 1.4x the time)."""
    from common.engine.speculation import DRAFTER_MARGIN, SLOWDOWN_MARGIN
    from common.scheduler.request import Request
    from common.spec_decode.adaptive import AdaptiveK

    assert SLOWDOWN_MARGIN < 1.06 / 1.1 < DRAFTER_MARGIN
    engine, _, prompts, _ = stateful_oracle_engine(case, _FixedPrices(1e-5))
    decoding, wanted = [], []
    for name, rate in (("sure", 1.0), ("unsure", low_rate)):
        req = Request(name, list(prompts[1]), greedy(MAX_TOKENS), max_tokens=MAX_TOKENS)
        req.adaptive_k = AdaptiveK(4, rate=rate)
        req.adaptive_k.update(400, round(400 * rate))  # enough evidence to outweigh the prior
        decoding.append(req)
        wanted.append(ProposalRequest(name, req.token_ids, req.num_tokens, 4, req.params))
    assert engine._fair_cap(decoding, wanted, set()) == cap
