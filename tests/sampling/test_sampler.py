from __future__ import annotations

import math
import random

import pytest
import torch

from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler, SamplingState

torch.set_num_threads(1)

EOS = 0


def _state(
    sampler: Sampler, prompt: list[int] | None = None, output: list[int] | None = None, **kw
) -> SamplingState:
    return sampler.new_state(SamplingParams(**kw), prompt or [], output)


def test_greedy_is_argmax_and_draws_no_randomness() -> None:
    sampler = Sampler(seed=0)
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0  # tie: first index wins
    states = [_state(sampler, temperature=0.0, seed=i if i % 2 else None) for i in range(6)]
    before = sampler.generator.get_state()
    seeded_before = [s.generator.get_state() for s in states if s.generator is not None]
    out = sampler.sample(logits, states)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 7
    assert torch.equal(sampler.generator.get_state(), before)
    seeded_after = [s.generator.get_state() for s in states if s.generator is not None]
    assert all(torch.equal(a, b) for a, b in zip(seeded_before, seeded_after))
    probs = sampler.compute_probs(logits, states)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_logprobs_are_raw_log_softmax() -> None:
    sampler = Sampler(seed=0)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2)) * 3
    states = [
        _state(sampler, [1, 2], [3], temperature=0.7, top_k=5, repetition_penalty=1.5, logprobs=4),
        _state(sampler, temperature=0.0, frequency_penalty=1.0, logprobs=0),
        _state(sampler, seed=3, top_p=0.8),
    ]
    out = sampler.sample(logits, states)
    ref = torch.log_softmax(logits, dim=-1)
    for row, tok in enumerate(out.token_ids):
        assert out.logprobs[row] == pytest.approx(ref[row, tok].item(), abs=1e-6)
    vals, ids = ref[0].topk(4)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == []
    assert out.top_logprobs[2] is None


def test_repetition_penalty_matches_hand_computation() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    # Seen in prompt: 0, 1; in output: 2 (twice), 5. Token 3 and 4 unseen.
    state = _state(sampler, [0, 1], [2, 2, 5], temperature=0.0, repetition_penalty=2.0)
    expected = torch.tensor([[1.0, -2.0, 0.25, -3.0, 1.0, 0.0]])
    probs = sampler.compute_probs(logits, [state])
    # Greedy on penalised logits: 4 (1.0) ties 0 (1.0) -> first index 0.
    assert probs.argmax().item() == expected.argmax().item() == 0
    hot = _state(sampler, [0, 1], [2, 2, 5], temperature=1.0, repetition_penalty=2.0)
    assert torch.allclose(sampler.compute_probs(logits, [hot]), torch.softmax(expected, -1), atol=1e-7)


def test_presence_and_frequency_penalties_match_hand_computation() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    # Prompt tokens do not count for OpenAI penalties; output has 1 x3, 2 x1.
    state = _state(sampler, [3, 3, 3], [1, 2, 1, 1], presence_penalty=0.5, frequency_penalty=0.25)
    expected = torch.tensor([[1.0, 1.0 - 0.75 - 0.5, 1.0 - 0.25 - 0.5, 1.0, 1.0]])
    assert torch.allclose(sampler.compute_probs(logits, [state]), torch.softmax(expected, -1), atol=1e-7)
    negative = _state(sampler, [], [4], presence_penalty=-1.0)
    probs = sampler.compute_probs(logits, [negative])
    assert torch.allclose(probs, torch.softmax(torch.tensor([[1.0, 1.0, 1.0, 1.0, 2.0]]), -1), atol=1e-7)


def test_penalties_apply_per_row_only() -> None:
    sampler = Sampler(seed=0)
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(5))
    states = [
        _state(sampler, [1, 2], [3, 3], repetition_penalty=1.7),
        _state(sampler, [1, 2], [3, 3]),
        _state(sampler, [4], [3, 5, 5], frequency_penalty=0.6, presence_penalty=0.1),
    ]
    batched = sampler.compute_probs(logits, states)
    for row, s in enumerate(states):
        alone = sampler.compute_probs(logits[row : row + 1], [s])
        assert torch.allclose(batched[row], alone[0], atol=1e-7)
    assert torch.allclose(batched[1], torch.softmax(logits[1], -1), atol=1e-7)


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, 6)
    logits[0, EOS] = 10.0
    logits[0, 4] = 9.0
    s = _state(sampler, [], [], temperature=0.0, min_tokens=2, stop_token_ids=[4])
    assert sampler.sample(logits, [s], eos_token_ids=[EOS]).token_ids == [1]
    s.output_token_ids.append(1)
    probs = sampler.compute_probs(logits, [s], eos_token_ids=EOS)
    assert probs[0, EOS] == 0.0 and probs[0, 4] == 0.0
    s.output_token_ids.append(1)
    assert sampler.sample(logits, [s], eos_token_ids=[EOS]).token_ids == [EOS]
    ignore = _state(sampler, [], [], temperature=0.0, min_tokens=2, stop_token_ids=[4], ignore_eos=True)
    assert sampler.sample(logits, [ignore], eos_token_ids=[EOS]).token_ids == [EOS]
    # Several EOS ids, and a random row: both masked to exactly zero probability.
    rand = _state(sampler, [], [], min_tokens=1)
    probs = sampler.compute_probs(logits, [rand], eos_token_ids=[EOS, 4])
    assert probs[0, EOS] == 0.0 and probs[0, 4] == 0.0 and probs[0].sum().item() == pytest.approx(1.0)


def _probs(sampler: Sampler, logits: torch.Tensor, **kw) -> torch.Tensor:
    return sampler.compute_probs(logits.unsqueeze(0), [_state(sampler, **kw)])[0]


def test_top_k_top_p_min_p_masks_exact() -> None:
    sampler = Sampler(seed=0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    logits = p.log()

    def renorm(keep: list[int]) -> torch.Tensor:
        out = torch.zeros_like(p)
        out[keep] = p[keep] / p[keep].sum()
        return out

    assert torch.allclose(_probs(sampler, logits, top_k=2), renorm([1, 3]), atol=1e-6)
    assert torch.allclose(_probs(sampler, logits, top_k=0), p, atol=1e-6)
    assert torch.allclose(_probs(sampler, logits, top_k=99), p, atol=1e-6)
    # top_p: keep a token iff the mass ranked above it is < top_p (0.4, 0.7, 0.85, 0.95 above).
    assert torch.allclose(_probs(sampler, logits, top_p=0.4), renorm([1]), atol=1e-6)
    assert torch.allclose(_probs(sampler, logits, top_p=0.65), renorm([1, 3]), atol=1e-6)
    assert torch.allclose(_probs(sampler, logits, top_p=0.8), renorm([1, 3, 4]), atol=1e-6)
    # min_p: keep p >= min_p * 0.4.
    assert torch.allclose(_probs(sampler, logits, min_p=0.3), renorm([1, 3, 4]), atol=1e-6)
    assert torch.allclose(_probs(sampler, logits, min_p=0.2), renorm([1, 2, 3, 4]), atol=1e-6)
    # top_p runs on the top_k-renormalised distribution: over {1, 3, 4} (mass 0.85) the mass
    # above 4 is 0.7 / 0.85 = 0.82, so top_p=0.8 drops it (it kept it without top_k).
    assert torch.allclose(_probs(sampler, logits, top_k=3, top_p=0.8), renorm([1, 3]), atol=1e-6)
    # Temperature first: T=2 flattens to sqrt(p) before the masks.
    q = p.sqrt() / p.sqrt().sum()
    got = _probs(sampler, logits, temperature=2.0, top_k=2)
    assert torch.allclose(got, torch.tensor([0, q[1], 0, q[3], 0]) / (q[1] + q[3]), atol=1e-6)


def test_top_k_keeps_ties_and_rows_are_independent() -> None:
    sampler = Sampler(seed=0)
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    states = [_state(sampler, top_k=3), _state(sampler, top_p=0.5, min_p=0.0)]
    probs = sampler.compute_probs(logits, states)
    assert (probs[0] > 0).tolist() == [True, False, True, True, True]
    # softmax([0, 1, 2, 3, 4])[4] = 0.636 >= 0.5 already: top_p keeps that token alone.
    assert (probs[1] > 0).tolist() == [False, False, False, False, True]


def _toy_logits(history_last: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A stand-in model: the next-token logits depend only on the request's last token."""
    return table[history_last]


def test_seeded_request_independent_of_batch() -> None:
    """A seeded request yields the same tokens alone and in shuffled batches with others."""
    vocab = 64
    table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(11)) * 2
    kinds = [
        dict(seed=42, temperature=0.9, top_k=20, frequency_penalty=0.3),
        dict(seed=7, temperature=1.3, top_p=0.9, repetition_penalty=1.2, min_tokens=3),
        dict(seed=2**63 - 5, min_p=0.05, presence_penalty=0.5),  # near the int64 limit
    ]

    def run(batch_seed: int | None, steps: int = 25) -> dict[int, list[int]]:
        sampler = Sampler(seed=batch_seed or 0)
        states = [sampler.new_state(SamplingParams(**kw), [1, 2, 3]) for kw in kinds]
        tracked = list(range(len(states)))
        if batch_seed is not None:
            # Neighbours: unseeded, greedy and other seeded requests.
            states += [sampler.new_state(SamplingParams(temperature=t), [5]) for t in (0.0, 1.0, 0.5)]
            states += [sampler.new_state(SamplingParams(seed=s), [6]) for s in (42, 43)]
        rng = random.Random(batch_seed)
        for _ in range(steps):
            order = list(range(len(states)))
            if batch_seed is not None:
                rng.shuffle(order)
            batch = [states[i] for i in order]
            last = torch.tensor([(s.output_token_ids or list(s.prompt_token_ids))[-1] for s in batch])
            out = sampler.sample(_toy_logits(last, table), batch, eos_token_ids=[EOS])
            for s, tok in zip(batch, out.token_ids):
                s.output_token_ids.append(tok)
        return {i: states[i].output_token_ids for i in tracked}

    alone = {}
    for i in range(len(kinds)):
        sampler = Sampler(seed=99)
        s = sampler.new_state(SamplingParams(**kinds[i]), [1, 2, 3])
        for _ in range(25):
            last = torch.tensor([(s.output_token_ids or [3])[-1]])
            s.output_token_ids.append(sampler.sample(_toy_logits(last, table), [s], [EOS]).token_ids[0])
        alone[i] = s.output_token_ids
    assert run(None) == alone
    assert run(1) == alone
    assert run(2) == alone
    assert len(set(map(tuple, alone.values()))) == 3  # sanity: the requests really differ


def test_seed_changes_tokens_and_unseeded_rows_use_engine_generator() -> None:
    logits = torch.zeros(1, 1000)
    a = Sampler(seed=0)
    t1 = [a.sample(logits, [a.new_state(SamplingParams(seed=1), [])]).token_ids[0] for _ in range(3)]
    t2 = [a.sample(logits, [a.new_state(SamplingParams(seed=2), [])]).token_ids[0] for _ in range(3)]
    assert len(set(t1)) == 1 and t1 != t2  # fresh state with the same seed: same first token
    b, c = Sampler(seed=5), Sampler(seed=5)
    sb = [b.sample(logits, [b.new_state(SamplingParams(), [])]).token_ids[0] for _ in range(5)]
    sc = [c.sample(logits, [c.new_state(SamplingParams(), [])]).token_ids[0] for _ in range(5)]
    assert sb == sc and len(set(sb)) > 1


def test_with_draft_extends_history_for_penalties() -> None:
    sampler = Sampler(seed=0)
    s = _state(sampler, [1], [2], frequency_penalty=1.0)
    d = s.with_draft([3, 3])
    assert s.output_token_ids == [2] and d.output_token_ids == [2, 3, 3]
    assert d.generator is s.generator
    probs = sampler.compute_probs(torch.zeros(1, 4), [d])[0]
    expected = torch.softmax(torch.tensor([0.0, 0.0, -1.0, -2.0]), -1)
    assert torch.allclose(probs, expected, atol=1e-7)


def test_empty_batch_and_low_precision_logits() -> None:
    sampler = Sampler(seed=0)
    out = sampler.sample(torch.zeros(0, 10), [])
    assert out.token_ids == [] and out.logprobs == [] and out.top_logprobs == []
    logits = torch.randn(2, 10).to(torch.bfloat16)
    states = [_state(sampler, temperature=0.0), _state(sampler, seed=1)]
    probs = sampler.compute_probs(logits, states)
    assert probs.dtype == torch.float32 and torch.allclose(probs.sum(-1), torch.ones(2))
    out = sampler.sample(logits, states)
    assert out.token_ids[0] == logits.float().argmax(-1)[0].item()
    assert all(math.isfinite(v) for v in out.logprobs)


def test_plain_rows_match_the_general_path():
    """Rows that sample plainly (no edits, no truncation, no top logprobs) take the one-call
    path; greedy and seeded rows give the general path's tokens, logprobs to float rounding."""
    from common.sampling.sampler import _samples_plainly

    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    logits[2, 7] = logits[2, 9] = logits[2].max() + 1.0  # a tie: the first index wins on both paths
    fast = [SamplingState.create(SamplingParams(temperature=0.0, max_tokens=8), [1, 2]) for _ in range(5)]
    general = [SamplingState.create(SamplingParams(temperature=0.0, max_tokens=8, logprobs=0), [1, 2]) for _ in range(5)]
    assert all(_samples_plainly(s, 300) for s in fast) and not any(_samples_plainly(s, 300) for s in general)
    a, b = Sampler().sample(logits, fast, [0]), Sampler().sample(logits, general, [0])
    assert a.token_ids == b.token_ids and a.token_ids[2] == 7
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    # Seeded draws at temperature 0.8: the same uniforms, so the same tokens on both paths
    # (top_p just under 1 sends a row to the general path without cutting any of these tokens).
    plain = [SamplingState.create(SamplingParams(temperature=0.8, seed=s), [1]) for s in range(5)]
    cut = [SamplingState.create(SamplingParams(temperature=0.8, seed=s, top_p=0.999999), [1]) for s in range(5)]
    assert all(_samples_plainly(s, 300) for s in plain) and not any(_samples_plainly(s, 300) for s in cut)
    for _ in range(20):
        a, b = Sampler().sample(logits, plain), Sampler().sample(logits, cut)
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_seeded_row_draws_the_same_in_any_batch():
    """A plain seeded row next to a row on the general path (top_k) gets the tokens it gets alone."""
    torch.manual_seed(1)
    logits = torch.randn(2, 500)

    def tokens(batch: bool) -> list[int]:
        seeded = SamplingState.create(SamplingParams(temperature=1.0, seed=7), [1])
        other = SamplingState.create(SamplingParams(temperature=1.0, top_k=5, seed=8), [1])
        sampler = Sampler(seed=0)
        if batch:
            return [sampler.sample(logits, [other, seeded]).token_ids[1] for _ in range(30)]
        return [sampler.sample(logits[1:], [seeded]).token_ids[0] for _ in range(30)]

    assert tokens(batch=True) == tokens(batch=False)
