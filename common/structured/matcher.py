"""One request's position in its grammar, and the batched mask over a step's rows.

    engine                              matcher (xgrammar GrammarMatcher)
    ------                              ---------------------------------
    sampler: fill_masks(rows)    ───>   fill_next_token_bitmask (per row, after any draft lookahead)
    token appended               ───>   accept(token); terminated -> the request stops ("stop")
    drafts verified              ───>   lookahead accepted then rolled back; the engine appends
                                        only the verified tokens, so rejected drafts never touch it

The matcher is rebuilt from tokens, never shipped: decode builds one from the spec and accepts
prefill's first token; preemption keeps it (the tokens are kept, only the KV is recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

# [32] bit positions of one int32 bitmask word.
_BITS = torch.arange(32, dtype=torch.int32)


class RequestGrammar:
    """A request's matcher: accepts its output tokens one by one and masks the next."""

    def __init__(self, compiled: xgr.CompiledGrammar, banned_tokens: torch.Tensor | None = None) -> None:
        """banned_tokens: [V] bool forbidden on top of the grammar (GrammarCompiler.banned_tokens).
        xgrammar 0.2.9 matchers roll back any number of tokens (verification needs up to k)."""
        self._matcher = xgr.GrammarMatcher(compiled)
        self.banned_tokens = banned_tokens
        self.num_accepted = 0

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar forbids it."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, lookahead: Sequence[int] = ()) -> None:
        """Writes the allowed next tokens into bitmask[row], as if `lookahead` had been accepted
        (draft positions). A lookahead the grammar forbids, or one past the end, leaves the row
        all-allowed: that position is never sampled, because verification rejects the draft
        token before it."""
        accepted = 0
        for token in lookahead:
            if not self.accept(token):
                break
            accepted += 1
        if accepted == len(lookahead) and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1
        if accepted:
            self._matcher.rollback(accepted)
            self.num_accepted -= accepted


def apply_grammar_masks(
    logits: torch.Tensor,
    raw_logits: torch.Tensor,
    grammars: Sequence[tuple[int, RequestGrammar, Sequence[int]]],
) -> None:
    """Masks forbidden tokens to -inf in place, one tensor op over every constrained row.

    logits: [N, V] processed logits; raw_logits: [N, V] the model's; grammars: (row, matcher,
    lookahead) of the constrained rows only, so unconstrained rows cost nothing. A row left with
    no finite logit (min_tokens banned EOS where the grammar allows only EOS) takes the grammar's
    mask over its raw logits instead: the grammar wins.
    """
    if not grammars:
        return
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab)  # [R, ceil(V / 32)] int32, CPU
    for j, (_, grammar, lookahead) in enumerate(grammars):
        grammar.fill(bitmask, j, lookahead)
    device = logits.device
    # [R, W, 32] -> [R, V] bool: bit b of word w allows token 32 * w + b.
    allowed = ((bitmask.to(device).unsqueeze(-1) >> _BITS.to(device)) & 1).bool()
    allowed = allowed.view(len(grammars), -1)[:, :vocab]
    banned = [(j, g.banned_tokens) for j, (_, g, _) in enumerate(grammars) if g.banned_tokens is not None]
    if banned:  # one compiler's rows share one tensor: a single masked write
        index = torch.tensor([j for j, _ in banned], device=device)
        allowed[index] &= ~banned[0][1].to(device)
    rows = torch.tensor([r for r, _, _ in grammars], device=device)
    masked = logits[rows].masked_fill(~allowed, -float("inf"))  # [R, V]
    dead = torch.isneginf(masked).all(dim=-1)  # [R]
    if bool(dead.any()):
        fallback = raw_logits[rows].to(masked.dtype).masked_fill(~allowed, -float("inf"))
        masked = torch.where(dead.unsqueeze(1), fallback, masked)
    logits[rows] = masked
