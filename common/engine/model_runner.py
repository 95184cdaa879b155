"""Turns a step's scheduled token spans into flat tensors, runs the model, returns logits.

Input of one step, for each sequence: the new tokens (a prefill chunk, one decode token, or a
decode token plus k draft tokens), the position of the first one, the block table, and how many
trailing positions need logits (0 mid-prompt, 1 to sample, k + 1 to verify drafts).

A step of more tokens than the model's pass limit (`max_pass_tokens`) runs as consecutive passes
(split_passes): with bf16-stored weights on the CPU, the fused decoder takes a pass of up to its
crossover, and past it PyTorch's path widens every matrix to a float32 copy per pass, which made
the draft's ingestion of four 44-token prompts (176 tokens) 0.0074 s a token against 0.0045 at 88;
and with float32 weights on a CPU where the fused passes beat one pass of PyTorch's layers (AMD
with AVX-512: SmolLM2-135M's four 128-token prompts in one step 680 vs 836 ms; cpu_decoder's
SPLITS_FLOAT32_STEPS).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.attention.metadata import AttentionMetadata
from common.kernels.cpu_decoder import SHORT_QUERY, FusedDecoder


@dataclass(slots=True)
class SequenceInput:
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int


def split_passes(batch: list[SequenceInput], max_tokens: int) -> list[list[SequenceInput]]:
    """`batch` as consecutive passes of at most `max_tokens` tokens each. A sequence may be cut:
    its pieces keep their order (a later piece attends to the KV an earlier one wrote) and only
    its trailing positions keep logits, so the passes' logits, concatenated, are the batch's."""
    passes: list[list[SequenceInput]] = [[]]
    room = max_tokens
    for s in batch:
        start = 0
        while True:
            if room == 0:
                passes.append([])
                room = max_tokens
            n = min(room, len(s.token_ids) - start)
            after = len(s.token_ids) - start - n  # this sequence's tokens in later pieces
            passes[-1].append(SequenceInput(s.token_ids[start : start + n], s.start_pos + start, s.block_table,
                                            min(n, max(0, s.num_logits - after))))  # fmt: skip
            room -= n
            start += n
            if start >= len(s.token_ids):
                break
    return [p for p in passes if p]


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
        self.max_pass_tokens = FusedDecoder.pass_limits(model, kv_caches)
        """Most tokens one model pass takes, (any step, a step whose queries are all short: at most
        SHORT_QUERY tokens a sequence), or None: any; larger steps run as consecutive passes."""

    def build_metadata(self, batch: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Plain Python lists, then one tensor each: at decode batch sizes a handful of small tensor
        # ops (repeat_interleave, cumsum, gathers) cost more than the whole step of a small model.
        query_lens = [len(s.token_ids) for s in batch]
        seq_lens = [s.start_pos + q for s, q in zip(batch, query_lens)]
        meta = AttentionMetadata.build(query_lens, seq_lens, [s.block_table for s in batch], self.block_size,
                                       self.device)  # fmt: skip
        ids_and_positions = [t for s in batch for t in s.token_ids]
        ids_and_positions.extend(p for s, end in zip(batch, seq_lens) for p in range(s.start_pos, end))
        both = torch.tensor(ids_and_positions, dtype=torch.long, device=self.device)  # one call, two views
        num_tokens = len(ids_and_positions) // 2
        return both[:num_tokens], both[num_tokens:], meta

    @torch.inference_mode()
    def execute(self, batch: list[SequenceInput]) -> torch.Tensor:
        """Returns float32 logits [sum(num_logits), vocab], in batch order."""
        limit = None
        if self.max_pass_tokens is not None and batch:
            limit = self.max_pass_tokens[max(len(s.token_ids) for s in batch) <= SHORT_QUERY]
        if limit is not None and sum(len(s.token_ids) for s in batch) > limit:
            parts = [self._execute(p) for p in split_passes(batch, limit)]
            parts = [p for p in parts if p.numel()]
            return torch.cat(parts) if parts else torch.empty((0, 0), dtype=torch.float32)
        return self._execute(batch)

    def _execute(self, batch: list[SequenceInput]) -> torch.Tensor:
        input_ids, positions, meta = self.build_metadata(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows: list[int] = []
        end = 0
        for s in batch:
            end += len(s.token_ids)
            rows.extend(range(end - s.num_logits, end))
        if not rows:
            return torch.empty((0, 0), dtype=torch.float32)
        if len(rows) == hidden.shape[0]:  # every position (a decode step): no gather
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
