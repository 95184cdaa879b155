"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

For draft tokens x_0..x_{k-1} drawn from q_j, with target distributions p_0..p_k from one pass:
  for j in 0..k-1: accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
                   on the first rejection emit a "recovered" token ~ norm(max(0, p_j - q_j)), stop;
  if all k were accepted, emit a "bonus" token ~ p_k.
The emitted tokens are distributed exactly as sampling from the target alone. A point-mass
proposal (n-gram) is q = one-hot(x_j). Greedy targets (p one-hot) reduce to "accept while the
draft equals the argmax, then emit the argmax": done without randomness so greedy output is
bit-identical to decoding without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EXP_FLOOR = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class Verification:
    num_accepted: int
    """Draft tokens accepted (0..k)."""
    token_ids: list[int]
    """Accepted drafts followed by the recovered or bonus token: num_accepted + 1 tokens."""


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    race = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / race.clamp_min_(_EXP_FLOOR)).argmax())


def verify(
    draft: list[int],
    target_probs: torch.Tensor,  # [k + 1, vocab] float32, the target's (processed) distributions
    draft_probs: torch.Tensor | None,  # [k, vocab] or None for a point-mass proposal
    greedy: bool,
    generator: torch.Generator | None,
) -> Verification:
    k = len(draft)
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        n = 0
        while n < k and draft[n] == best[n]:
            n += 1
        return Verification(n, draft[:n] + [best[n]])
    for j, x in enumerate(draft):
        p = target_probs[j]
        q_x = 1.0 if draft_probs is None else float(draft_probs[j, x])
        p_x = float(p[x])
        u = float(torch.rand((), generator=generator))
        # Accept with probability min(1, p/q). p_x > 0 keeps a token the target forbids (a grammar
        # mask, top-k) out even when u is exactly 0.
        if q_x > 0 and p_x > 0 and u * q_x <= p_x:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        total = float(residual.sum())
        # total == 0 only when p == q exactly, where rejection has probability 0; guard anyway.
        token = _draw(residual / total if total > 0 else p, generator)
        return Verification(j, draft[:j] + [token])
    return Verification(k, draft + [_draw(target_probs[k], generator)])
