"""Prompt-lookup (n-gram) proposer: no draft model, runs in-process.

If the context's last n tokens (n from max_n down to min_n) occurred earlier in the context,
propose the k tokens that followed that earlier occurrence (the most recent one). Works well on
inputs that copy from the prompt (code edits, summaries, retrieval answers).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.spec_decode.proposer import Proposal, ProposalRequest


@dataclass
class NgramProposer:
    max_n: int = 4
    min_n: int = 1
    max_lookback: int = 4096
    """Only the last this-many tokens are searched: keeps the cost bounded per step."""

    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        out: dict[str, Proposal] = {}
        for r in requests:
            tokens = self._lookup(r.token_ids[-self.max_lookback :], r.k)
            if tokens:
                out[r.request_id] = Proposal(tokens)
        return out

    def _lookup(self, ctx: list[int], k: int) -> list[int]:
        for n in range(min(self.max_n, len(ctx) - 1), self.min_n - 1, -1):
            tail = ctx[-n:]
            # Scan backwards for the most recent earlier occurrence of the tail.
            for start in range(len(ctx) - n - 1, -1, -1):
                if ctx[start : start + n] == tail:
                    follow = ctx[start + n : start + n + k]
                    if follow:
                        return follow
        return []

    def release(self, request_ids: list[str]) -> None:
        return None
