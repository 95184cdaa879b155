"""What one forward step tells the attention layers about the batch.

The batch is a flat list of query tokens from several sequences, laid end to end:

    tokens:      [ s0 t0 t1 t2 | s1 t0 | s2 t0 t1 ]        (num_tokens = 6)
    query_start_loc = [0, 3, 4, 6]
    seq_lens        = [ctx0 + 3, ctx1 + 1, ctx2 + 2]      (cached prefix + new tokens)

Query token j of sequence b sits at position seq_lens[b] - query_len[b] + j and attends to every
key of that sequence at a position <= its own: the cached prefix (read through the block table)
plus the new tokens before it. That one rule serves decode (query_len 1), chunked prefill
(query_len = chunk) and speculative verification (query_len = k + 1).

KV slot of the token at position p of sequence b:
    block_tables[b][p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot each new token's K/V goes to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: start of each sequence's queries
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (prefix + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU paths can split the batch without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @staticmethod
    def build(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds the tensors from plain lists (one entry per sequence)."""
        assert len(query_lens) == len(seq_lens) == len(block_tables)
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=1) or 1
        n = len(seq_lens)
        # The int32 fields as views of one tensor: one torch.tensor call (and one copy to a device)
        # instead of three, a few microseconds of every step of a small model.
        ints = [0]
        for q_len in query_lens:
            ints.append(ints[-1] + q_len)
        ints.extend(seq_lens)
        for t in block_tables:
            ints.extend(t)
            ints.extend([0] * (max_blocks - len(t)))
        flat = torch.tensor(ints, dtype=torch.int32, device=device)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=flat[: n + 1],
            seq_lens=flat[n + 1 : 2 * n + 1],
            block_tables=flat[2 * n + 1 :].view(n, max_blocks),
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )
