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

from common.structured.compiler import TokenBans

# [32] bit positions of one int32 bitmask word.
_BITS = torch.arange(32, dtype=torch.int32)


class RequestGrammar:
    """A request's matcher: accepts its output tokens one by one and masks the next."""

    def __init__(self, compiled: xgr.CompiledGrammar, bans: TokenBans | None = None) -> None:
        """bans: tokens forbidden on top of the grammar (GrammarCompiler.token_bans).
        xgrammar 0.2.9 matchers roll back any number of tokens (verification needs up to k)."""
        self._matcher = xgr.GrammarMatcher(compiled)
        self.bans = bans
        self.num_accepted = 0
        self._last_token: int | None = None

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar forbids it."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            return False
        self.num_accepted += 1
        self._last_token = int(token)
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, lookahead: Sequence[int] = ()) -> torch.Tensor | None:
        """Writes the allowed next tokens into bitmask[row], as if `lookahead` had been accepted
        (draft positions), and returns the [V] bool tokens to ban on top (or None). A lookahead
        the grammar forbids, or one past the end, leaves the row all-allowed: that position is
        never sampled, because verification rejects the draft token before it."""
        last = self._last_token
        accepted = 0
        for token in lookahead:
            if not self.accept(token):
                break
            accepted += 1
        usable = accepted == len(lookahead) and not self._matcher.is_terminated()
        if usable:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = -1
        bans = None
        if usable and self.bans is not None:
            bans = self.bans.after_ed if self._last_token in self.bans.ends_with_ed else self.bans.always
        if accepted:
            self._matcher.rollback(accepted)
            self.num_accepted -= accepted
        self._last_token = last
        return bans


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
    bans = [grammar.fill(bitmask, j, lookahead) for j, (_, grammar, lookahead) in enumerate(grammars)]
    device = logits.device
    # [R, W, 32] -> [R, V] bool: bit b of word w allows token 32 * w + b.
    allowed = ((bitmask.to(device).unsqueeze(-1) >> _BITS.to(device)) & 1).bool()
    allowed = allowed.view(len(grammars), -1)[:, :vocab]
    by_ban: dict[int, tuple[torch.Tensor, list[int]]] = {}  # rows share a few ban tensors
    for j, ban in enumerate(bans):
        if ban is not None:
            by_ban.setdefault(id(ban), (ban, []))[1].append(j)
    for ban, rows_j in by_ban.values():
        allowed[torch.tensor(rows_j, device=device)] &= ~ban.to(device)
    rows = torch.tensor([r for r, _, _ in grammars], device=device)
    masked = logits[rows].masked_fill(~allowed, -float("inf"))  # [R, V]
    dead = torch.isneginf(masked).all(dim=-1)  # [R]
    if bool(dead.any()):
        fallback = raw_logits[rows].to(masked.dtype).masked_fill(~allowed, -float("inf"))
        masked = torch.where(dead.unsqueeze(1), fallback, masked)
    logits[rows] = masked
