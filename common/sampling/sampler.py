"""Batched sampling: logits of N requests in, one token per request out.

Pipeline for each row (everything vectorised over rows except the seeded random draw):

    raw logits ─┬─> log_softmax ─> logprobs / top_logprobs     (what the model said; no processing)
                └─> min_tokens mask -> repetition penalty -> presence/frequency penalties -> logit_bias
                      -> grammar mask (constrained rows only, one tensor op; common/structured)
                      ├─ temperature == 0: one-hot at argmax                         (greedy)
                      └─ / temperature -> top_k -> top_p -> min_p -> softmax -> draw   (random)

Rows that nothing edits (no penalties, bias, grammar or pending min_tokens, no top-k / top-p /
min-p, no top logprobs: most decode rows) skip the pipeline: their argmax, or their draw from the
plain softmax at their temperature, and the raw logprob come from one native call over the batch
(common/kernels/sample_rows.cpp; its torch reference where it is not built), 3-20x cheaper than
the passes above (benchmarks/sampling_step.py). Each row's path depends on its own request only.

`compute_probs` returns exactly the distribution `sample` draws from, so speculative decoding's
rejection sampler can reuse it. The draw is by inverse CDF: one uniform u per row, the token is
the first whose cumulative probability exceeds u * total. A seeded request takes exactly one
number from its own generator per step whatever the batch holds, so its tokens depend only on
its seed and its history; the per-row generator calls are then cheap and the search is batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from common.kernels import sample_rows
from common.kernels.sample_rows import inverse_cdf
from common.sampling.params import SamplingParams
from common.structured.matcher import RequestGrammar, apply_grammar_masks


@dataclass(slots=True)
class SamplingState:
    """What the sampler needs to know about one request across steps.

    `output_token_ids` is the engine's own list, appended to in place after every step; the
    penalties and min_tokens read it at each call, so nothing here needs updating.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    # Own RNG when params.seed is set; None means draw from the sampler's shared generator.
    generator: torch.Generator | None = None
    # The request's grammar matcher when params.grammar is set (the engine builds it).
    grammar: RequestGrammar | None = None
    # Draft tokens the grammar must be advanced past before masking (verification positions).
    grammar_lookahead: tuple[int, ...] = ()
    # Prompt ids as a tensor on the logits' device, built on first use by the repetition penalty.
    _prompt_tensor: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        """`device` must be the device the logits live on (a generator is tied to one device)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed % 2**64)
        return cls(
            params=params,
            prompt_token_ids=prompt_token_ids,
            output_token_ids=[] if output_token_ids is None else output_token_ids,
            generator=generator,
        )

    def with_draft(self, draft_token_ids: Sequence[int]) -> SamplingState:
        """The same request as if `draft_token_ids` had already been output.

        For speculative verification: position j's distribution is computed from the state
        extended by draft[:j]. The generator is shared, so the draws stay on the request's stream.
        """
        return SamplingState(
            params=self.params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids) + list(draft_token_ids),
            generator=self.generator,
            grammar=self.grammar,
            grammar_lookahead=self.grammar_lookahead + tuple(draft_token_ids),
            _prompt_tensor=self._prompt_tensor,
        )


@dataclass(slots=True)
class SamplerOutput:
    """One sampled token per row, with log-probabilities under the RAW model logits."""

    token_ids: list[int]
    # log_softmax(raw logits)[chosen]: equals transformers' torch.log_softmax of the model's
    # logits; penalties, temperature and truncation are not reflected here.
    logprobs: list[float]
    # Per row: None when params.logprobs is None, else the params.logprobs most likely
    # (token_id, raw logprob) pairs, most likely first ([] for logprobs=0).
    top_logprobs: list[list[tuple[int, float]] | None]


class Sampler:
    """Stateless apart from the generator shared by unseeded requests."""

    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % 2**64)

    def new_state(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        output_token_ids: list[int] | None = None,
        grammar: RequestGrammar | None = None,
    ) -> SamplingState:
        state = SamplingState.create(params, prompt_token_ids, output_token_ids, self.device)
        state.grammar = grammar
        return state

    def skip_draw(self, state: SamplingState, vocab: int) -> None:
        """Advances a seeded request's generator by one sampling step without sampling (its token
        was drawn elsewhere from the same seed, e.g. the first token by a prefill worker)."""
        if state.generator is not None:
            _skip(state.generator, vocab, self.device)

    def compute_probs(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        eos_token_ids: int | Sequence[int] = (),
    ) -> torch.Tensor:
        """The distribution `sample` draws from, one row per state.

        logits: [N, V] (any float dtype; computed in float32). Returns [N, V] float32 probs;
        greedy rows are one-hot at the argmax of the penalised logits.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        raw = logits
        # [N, V] float32, a copy: the raw logits are still needed for logprobs.
        logits = logits.to(torch.float32, copy=True)
        if logits.shape[0] == 0:
            return logits
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        _apply_min_tokens(logits, states, eos)
        _apply_repetition_penalty(logits, states)
        _apply_presence_frequency_penalties(logits, states)
        _apply_logit_bias(logits, states)
        constrained = [(i, s.grammar, s.grammar_lookahead) for i, s in enumerate(states) if s.grammar is not None]
        apply_grammar_masks(logits, raw, constrained)

        probs = torch.zeros_like(logits)  # [N, V]
        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy_rows:
            g = torch.tensor(greedy_rows, device=logits.device)
            # torch.argmax returns the first maximal index, so ties break the same way every time.
            probs[g, logits[g].argmax(dim=-1)] = 1.0
        if random_rows:
            r = torch.tensor(random_rows, device=logits.device)
            params = [states[i].params for i in random_rows]
            temperature = torch.tensor([p.temperature for p in params], device=logits.device)
            scaled = logits[r] / temperature.unsqueeze(1)  # [R, V]
            scaled = _apply_top_k_top_p_min_p(scaled, params)
            probs[r] = torch.softmax(scaled, dim=-1)
        return probs

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        eos_token_ids: int | Sequence[int] = (),
    ) -> SamplerOutput:
        """Draws one token per row. logits: [N, V], the model's raw output for each request."""
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SamplerOutput([], [], [])
        vocab = logits.shape[1]
        plain = [i for i, s in enumerate(states) if _samples_plainly(s, vocab)]
        if len(plain) == num_rows:  # the common decode step: nothing edits the logits
            tokens, logprobs = self._sample_plain(logits, states)
            return SamplerOutput(tokens, logprobs, [None] * num_rows)
        if not plain:
            return self._sample_processed(logits, states, eos_token_ids)
        # A mixed batch: each row takes the path its own request takes alone, so a seeded
        # request's tokens do not depend on what else is in the batch.
        chosen = set(plain)
        rest = [i for i in range(num_rows) if i not in chosen]
        index = lambda rows: torch.tensor(rows, device=logits.device)  # noqa: E731
        tokens, logprobs = self._sample_plain(logits[index(plain)], [states[i] for i in plain])
        other = self._sample_processed(logits[index(rest)], [states[i] for i in rest], eos_token_ids)
        out = SamplerOutput([0] * num_rows, [0.0] * num_rows, [None] * num_rows)
        for j, i in enumerate(plain):
            out.token_ids[i], out.logprobs[i] = tokens[j], logprobs[j]
        for j, i in enumerate(rest):
            out.token_ids[i], out.logprobs[i], out.top_logprobs[i] = other.token_ids[j], other.logprobs[j], other.top_logprobs[j]
        return out

    def _sample_plain(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> tuple[list[int], list[float]]:
        """Rows whose logits need no edits (_samples_plainly): greedy or a plain softmax draw, in
        one native call (common/kernels/sample_rows.py) or its PyTorch reference. The uniforms
        come from the same generators, one per drawn row, as on the processed path."""
        temperature = [s.params.temperature for s in states]
        u = self._uniforms(states)
        if sample_rows.takes(logits):
            return sample_rows.sample_rows(logits, temperature, u)
        return sample_rows.reference(logits, temperature, u)

    def _uniforms(self, states: Sequence[SamplingState]) -> list[float]:
        """The step's uniform per row (0.0 for greedy rows, which draw none): the unseeded rows'
        from the shared generator in one call, in row order, then each seeded row's from its own."""
        u = [0.0] * len(states)
        shared = [i for i, s in enumerate(states) if s.generator is None and not s.params.is_greedy]
        if shared:
            for i, x in zip(shared, torch.rand(len(shared), generator=self.generator, device=self.device).tolist()):
                u[i] = x
        for i, s in enumerate(states):
            if s.generator is not None and not s.params.is_greedy:
                # Per row on purpose: each seeded request draws from its own generator.
                u[i] = torch.rand((), generator=s.generator, device=self.device).item()
        return u

    def _sample_processed(
        self,
        logits: torch.Tensor,
        states: Sequence[SamplingState],
        eos_token_ids: int | Sequence[int] = (),
    ) -> SamplerOutput:
        """Rows with logit edits, truncation or top logprobs: compute_probs' distribution."""
        num_rows = logits.shape[0]
        probs = self.compute_probs(logits, states, eos_token_ids)  # [N, V]
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=probs.device)

        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        drawn = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if greedy_rows:
            g = torch.tensor(greedy_rows, device=probs.device)
            token_ids[g] = probs[g].argmax(dim=-1)
        if drawn:
            uniforms = self._uniforms(states)
            rows = torch.tensor(drawn, device=probs.device)
            u = torch.tensor([uniforms[i] for i in drawn], dtype=torch.float32, device=probs.device)
            token_ids[rows] = inverse_cdf(probs[rows], u)

        raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [N, V]
        chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [N]
        top: list[list[tuple[int, float]] | None] = [None] * num_rows
        want = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        max_n = max((states[i].params.logprobs or 0 for i in want), default=0)
        top_vals: list[list[float]] = []
        top_ids: list[list[int]] = []
        if max_n > 0:
            w = torch.tensor(want, device=probs.device)
            vals, ids = raw_logprobs[w].topk(min(max_n, raw_logprobs.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        for j, i in enumerate(want):
            n = states[i].params.logprobs or 0
            top[i] = list(zip(top_ids[j][:n], top_vals[j][:n])) if n else []
        return SamplerOutput(token_ids.tolist(), chosen.tolist(), top)


def _samples_plainly(s: SamplingState, vocab: int) -> bool:
    """Nothing edits this row's logits (no penalties, bias, grammar, pending min_tokens), no
    truncation changes its draw (top-k / top-p / min-p off, or greedy, where they keep the argmax
    anyway) and no top logprobs are asked for: its token is the argmax of the raw logits, or a
    draw from their plain softmax at its temperature."""
    p = s.params
    if not (s.grammar is None and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and len(s.output_token_ids) >= p.min_tokens):  # fmt: skip
        return False
    return p.is_greedy or ((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0)


def _skip(generator: torch.Generator, vocab: int, device: torch.device) -> None:
    torch.rand((), generator=generator, device=device)  # what one sampling step consumes


def _history_index(
    rows: list[int], states: Sequence[SamplingState], with_prompt: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row position in `rows`, token id) pairs of each row's history, for scatters."""
    row_parts: list[torch.Tensor] = []
    tok_parts: list[torch.Tensor] = []
    for pos, i in enumerate(rows):
        s = states[i]
        parts = []
        if with_prompt and len(s.prompt_token_ids):
            if s._prompt_tensor is None or s._prompt_tensor.device != device:
                s._prompt_tensor = torch.as_tensor(
                    list(s.prompt_token_ids), dtype=torch.int64, device=device
                )
            parts.append(s._prompt_tensor)
        if s.output_token_ids:
            parts.append(torch.tensor(s.output_token_ids, dtype=torch.int64, device=device))
        for p in parts:
            tok_parts.append(p)
            row_parts.append(torch.full_like(p, pos))
    if not tok_parts:
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return empty, empty
    return torch.cat(row_parts), torch.cat(tok_parts)


def _apply_min_tokens(logits: torch.Tensor, states: Sequence[SamplingState], eos: list[int]) -> None:
    """Bans EOS (unless ignore_eos) and stop_token_ids until min_tokens tokens are out."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        p = s.params
        if len(s.output_token_ids) >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos)
        for t in banned:
            if t < vocab:  # an id outside the vocab can never be drawn anyway
                rows.append(i)
                cols.append(t)
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        logits[index] = -float("inf")


def _apply_repetition_penalty(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """HF/CTRL semantics over prompt + output: seen logits > 0 are divided, < 0 multiplied."""
    rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if not rows:
        return
    device = logits.device
    row_pos, tokens = _history_index(rows, states, with_prompt=True, device=device)
    seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)  # [R, V]
    seen[row_pos, tokens] = True
    penalty = torch.tensor([states[i].params.repetition_penalty for i in rows], device=device)
    penalty = penalty.unsqueeze(1)  # [R, 1]
    r = torch.tensor(rows, device=device)
    sub = logits[r]
    penalised = torch.where(sub > 0, sub / penalty, sub * penalty)
    logits[r] = torch.where(seen, penalised, sub)


def _apply_presence_frequency_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """OpenAI semantics over output tokens: logit -= frequency * count + presence * (count > 0)."""
    rows = [
        i
        for i, s in enumerate(states)
        if (s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0) and s.output_token_ids
    ]
    if not rows:
        return
    device = logits.device
    row_pos, tokens = _history_index(rows, states, with_prompt=False, device=device)
    counts = torch.zeros(len(rows), logits.shape[1], dtype=torch.float32, device=device)  # [R, V]
    counts.index_put_((row_pos, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
    freq = torch.tensor([states[i].params.frequency_penalty for i in rows], device=device).unsqueeze(1)
    pres = torch.tensor([states[i].params.presence_penalty for i in rows], device=device).unsqueeze(1)
    r = torch.tensor(rows, device=device)
    logits[r] = logits[r] - freq * counts - pres * (counts > 0).to(torch.float32)


def _apply_logit_bias(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    """OpenAI logit_bias: one scatter-add of every row's (token, bias) pairs. Ids beyond this
    logits' width were refused at the edge; they are skipped here rather than crash a batch."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    vocab = logits.shape[1]
    for i, s in enumerate(states):
        for token, bias in s.params.logit_bias:
            if token < vocab:
                rows.append(i)
                cols.append(token)
                vals.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=device), accumulate=True)


def _apply_top_k_top_p_min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Masks temperature-scaled logits [R, V] with -inf, in the order top_k, top_p, min_p.

    top_k keeps every token >= the k-th largest value (ties kept). top_p keeps the smallest
    most-likely prefix whose mass, renormalised over the top_k survivors, reaches top_p: a token
    stays iff the mass ranked strictly above it is < top_p. min_p keeps p_i >= min_p * p_max;
    being a ratio, it is the same before or after renormalisation.
    """
    vocab = scaled.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if all(k == vocab for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return scaled
    device = scaled.device
    k = torch.tensor(top_k, device=device).unsqueeze(1)
    k_max = max(top_k)
    sorted_vals = sorted_idx = None
    if k_max <= vocab // 4:
        # Every row truncates to a small top-k: a partial sort of k_max entries replaces the full
        # one, valid when no row's k-th value is tied with a value outside its top k.
        vals, idx = scaled.topk(k_max, dim=-1)  # [R, k_max], descending
        kth = vals.gather(1, k - 1)
        if bool(((scaled >= kth).sum(dim=1, keepdim=True) == k).all()):
            sorted_vals, sorted_idx = vals, idx
    if sorted_vals is None:
        # Stable, so ties keep vocab order and the top_p cut is the same on every run.
        sorted_vals, sorted_idx = scaled.sort(dim=-1, descending=True, stable=True)  # [R, V]
    kth = sorted_vals.gather(1, k - 1)  # [R, 1]
    keep = sorted_vals >= kth
    sorted_vals = sorted_vals.masked_fill(~keep, -float("inf"))
    sorted_probs = torch.softmax(sorted_vals, dim=-1)
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # p == 1 rows skip the cut: float rounding can push the cumulative sum past 1.
    keep &= (mass_above < p) | (p >= 1.0)
    m = torch.tensor(min_p, device=device).unsqueeze(1)
    keep &= sorted_probs >= m * sorted_probs[:, :1]
    keep_vocab = torch.zeros_like(scaled, dtype=torch.bool).scatter_(1, sorted_idx, keep)  # back to vocab order
    return scaled.masked_fill(~keep_vocab, -float("inf"))
