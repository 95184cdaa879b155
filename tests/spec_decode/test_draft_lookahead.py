"""Draft lookahead: between calls the draft keeps drafting greedy sequences past its proposals. A
next call whose context continues along that lookahead is answered from it (no forward) with the
proposals a fresh worker would make; one that leaves it (a rejected draft, another bonus token)
rolls the lookahead's KV back. Sampled sequences never look ahead. Through the Draft service, idle
time is spent on it and the target's greedy output stays identical to no speculation."""

from __future__ import annotations

import asyncio

from common.spec_decode.draft_worker import DraftSampling, DraftStatus, DraftUpdate
from services.draft.worker_loop import DraftLoop
from tests.engine.engine_helpers import greedy, hf_greedy, random_prompts
from tests.spec_decode.test_draft_worker import VOCAB, at_baseline, make_worker, upd


def _fresh(model, ctx: list[int], k: int) -> list[int]:
    return make_worker(model).propose([upd("a", ctx, len(ctx), k, reset=True)])[0].token_ids


def _counting_forwards(worker) -> list[int]:
    calls: list[int] = []
    execute = worker.runner.execute

    def counted(batch):
        calls.append(len(batch))
        return execute(batch)

    worker.runner.execute = counted
    return calls


def test_a_call_on_course_is_answered_from_the_lookahead(tiny_model) -> None:
    w = make_worker(tiny_model)
    prompt = random_prompts([23], VOCAB, seed=5)[0]
    k = 3
    first = w.propose([upd("a", prompt, len(prompt), k, reset=True)])[0].token_ids
    steps = 0
    while w.extend_lookahead():
        steps += 1
    assert steps == k + 1  # the bonus token's guess, then k more
    w.check_integrity()
    lookahead = w._seqs[("a", 0)].lookahead
    assert len(lookahead) == k + 1
    # The target accepts all k and its bonus token is the draft's own guess.
    ctx = prompt + first + [lookahead[0]]
    forwards = _counting_forwards(w)
    res = w.propose([upd("a", [lookahead[0]], len(ctx), k, accepted=k)])[0]
    assert res.status is DraftStatus.OK and forwards == []  # no forward at all
    assert res.token_ids == lookahead[1:] == _fresh(tiny_model, ctx, k)
    w.check_integrity()
    # The next calls keep going (extend again, answer again), still equal to a fresh worker.
    for _ in range(3):
        while w.extend_lookahead():
            pass
        la = w._seqs[("a", 0)].lookahead
        ctx = ctx + res.token_ids + [la[0]]
        res = w.propose([upd("a", [la[0]], len(ctx), k, accepted=k)])[0]
        assert res.token_ids == _fresh(tiny_model, ctx, k)
        w.check_integrity()
    w.release(request_ids=["a"])
    assert at_baseline(w)


def test_a_call_off_course_rolls_the_lookahead_back(tiny_model) -> None:
    w = make_worker(tiny_model)
    prompt = random_prompts([30], VOCAB, seed=6)[0]
    first = w.propose([upd("a", prompt, len(prompt), 4, reset=True)])[0].token_ids
    while w.extend_lookahead():
        pass
    bonus = w._seqs[("a", 0)].lookahead[0]
    other = (bonus + 1) % VOCAB or 9
    cases = [(4, other), (2, other), (0, other)]  # all accepted but another bonus; partial; none
    for accepted, token in cases:
        ctx = prompt + first[:accepted] + [token]
        res = w.propose([upd("a", [token], len(ctx), 4, accepted=accepted)])[0]
        assert res.token_ids == _fresh(tiny_model, ctx, 4), (accepted, token)
        w.check_integrity()
        while w.extend_lookahead():
            pass
        prompt, first = ctx, res.token_ids
    # A partial lookahead (fewer tokens than k) is used and drafting continues after it.
    w.propose([upd("a", [5], len(prompt) + 5, 4, accepted=4)])
    w.extend_lookahead()
    w.extend_lookahead()
    seq = w._seqs[("a", 0)]
    assert len(seq.lookahead) == 2
    ctx = seq.committed + seq.pending + [seq.lookahead[0]]
    res = w.propose([upd("a", [seq.lookahead[0]], len(ctx), 4, accepted=4)])[0]
    assert res.token_ids == _fresh(tiny_model, ctx, 4)
    w.release(request_ids=["a"])
    assert at_baseline(w)


def test_sampled_sequences_do_not_look_ahead(tiny_model) -> None:
    w = make_worker(tiny_model)
    prompt = random_prompts([12], VOCAB, seed=7)[0]
    sampled = DraftUpdate("s", 0, True, 0, prompt, len(prompt), 3, DraftSampling(temperature=0.8, seed=1))
    assert w.propose([sampled])[0].status is DraftStatus.OK
    assert w.extend_lookahead() == 0
    w.release(request_ids=["s"])
    assert at_baseline(w)


def test_the_loop_looks_ahead_when_idle(tiny_model) -> None:
    w = make_worker(tiny_model)
    prompt = random_prompts([16], VOCAB, seed=8)[0]

    async def scenario() -> int:
        loop = DraftLoop(w, lookahead=True)
        await loop.call(lambda worker: worker.propose([upd("a", prompt, len(prompt), 2, reset=True)]))
        # The loop fills the lookahead on its own thread (k + 1 = 3 steps), then stops.
        while loop.lookahead_steps < 3:
            await asyncio.sleep(0.01)  # no deadline: the condition is the mechanism's own counter
        await loop.call(lambda worker: None)
        steps = loop.lookahead_steps
        await loop.stop()
        return steps

    assert asyncio.run(scenario()) == 3
    assert len(w._seqs[("a", 0)].lookahead) == 3
    w.check_integrity()


def test_engine_greedy_parity_with_lookahead_between_steps(tiny_model) -> None:
    """The engine speculating with a worker that looks ahead after every propose: output equals
    transformers, and the lookahead was used (some calls needed no forward)."""
    from common.spec_decode.draft_worker import DraftWorkerProposer
    from tests.spec_decode.test_draft_worker import spec_engine

    worker = make_worker(tiny_model, num_kv_blocks=256)
    proposer = DraftWorkerProposer(worker)
    inner = proposer.propose

    def propose_then_look_ahead(requests):
        out = inner(requests)
        while worker.extend_lookahead():
            pass
        return out

    proposer.propose = propose_then_look_ahead
    forwards = _counting_forwards(worker)
    prompts = random_prompts([5, 19, 40], VOCAB, seed=9)
    engine = spec_engine(tiny_model, proposer, k=3, adaptive=False)
    outs = engine.generate(prompts, greedy(16))
    assert [o[0].token_ids for o in outs] == hf_greedy(tiny_model, prompts, 16)
    assert engine.spec_stats.num_draft_tokens > 0
    engine.check_integrity()
    assert forwards  # drafting happened (lookahead steps count as forwards too)
