"""Turns a step's scheduled token spans into flat tensors, runs the model, returns logits.

Input of one step, for each sequence: the new tokens (a prefill chunk, one decode token, or a
decode token plus k draft tokens), the position of the first one, the block table, and how many
trailing positions need logits (0 mid-prompt, 1 to sample, k + 1 to verify drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class SequenceInput:
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    def build_metadata(self, batch: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Plain Python lists, then one tensor each: at decode batch sizes a handful of small tensor
        # ops (repeat_interleave, cumsum, gathers) cost more than the whole step of a small model.
        query_lens = [len(s.token_ids) for s in batch]
        seq_lens = [s.start_pos + q for s, q in zip(batch, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, [s.block_table for s in batch], self.block_size,
                                       self.device)  # fmt: skip
        positions = [p for s, end in zip(batch, seq_lens) for p in range(s.start_pos, end)]
        input_ids = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.long, device=self.device)
        return input_ids, torch.tensor(positions, dtype=torch.long, device=self.device), meta

    @torch.inference_mode()
    def execute(self, batch: list[SequenceInput]) -> torch.Tensor:
        """Returns float32 logits [sum(num_logits), vocab], in batch order."""
        input_ids, positions, meta = self.build_metadata(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows: list[int] = []
        end = 0
        for s in batch:
            end += len(s.token_ids)
            rows.extend(range(end - s.num_logits, end))
        if not rows:
            return torch.empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
