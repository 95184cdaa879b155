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
        query_lens = [len(s.token_ids) for s in batch]
        seq_lens = [s.start_pos + q for s, q in zip(batch, query_lens)]
        max_blocks = max(len(s.block_table) for s in batch)
        tables = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for i, s in enumerate(batch):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        flat_ids = [t for s in batch for t in s.token_ids]
        seq_index = torch.repeat_interleave(torch.arange(len(batch)), torch.tensor(query_lens))
        starts = torch.tensor([0] + query_lens).cumsum(0)
        # position of token j of sequence b = start_pos[b] + j
        offsets = torch.arange(len(flat_ids)) - starts[:-1][seq_index]
        positions = torch.tensor([s.start_pos for s in batch])[seq_index] + offsets
        blocks = tables[seq_index, positions // self.block_size].long()
        slot_mapping = blocks * self.block_size + positions % self.block_size
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=starts.to(torch.int32).to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=tables.to(self.device),
            block_size=self.block_size,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        return input_ids, positions.to(self.device), meta

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
