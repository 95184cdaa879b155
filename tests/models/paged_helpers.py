"""Drives our decoder through a paged KV cache, the way the engine will, for the parity tests.

Blocks are handed out from a shuffled free list, so every block table is non-contiguous:

    seq 0 table: [37, 5, 52, ...]   seq 1 table: [11, 60, 2, ...]
"""

from __future__ import annotations

import random

import torch

from common.attention.metadata import AttentionMetadata
from common.models.config import ModelConfig
from common.models.decoder import DecoderModel


class PagedRunner:
    def __init__(self, model: DecoderModel, cfg: ModelConfig, num_blocks: int = 96, block_size: int = 4, seed: int = 0):
        self.model, self.cfg, self.block_size = model, cfg, block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(cfg.num_layers)
        ]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens already in the cache, per sequence

    def step(self, chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        """Runs one batched forward of new tokens per sequence; returns each one's logits [n, vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        query_lens, seq_lens, tables = [], [], []
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(list(table))
            self.lengths[seq] = end
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return list(logits.split(query_lens))


def greedy_generate(runner: PagedRunner, prompt: list[int], max_new_tokens: int, eos_ids: list[int]) -> list[int]:
    """Prefill then one token per step, stopping at EOS like transformers' generate."""
    logits = runner.step({0: prompt})[0]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos_ids:
            break
        logits = runner.step({0: [token]})[0]
    return out
