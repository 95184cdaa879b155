"""The torch reference against plain dense causal attention on contiguous K/V, one sequence at a time.

This check is independent of the paged layout: K/V for each sequence are generated contiguously,
scattered into a paged cache through a shuffled block table, and the reference must give the same
answer as a hand-written softmax(QK^T) V over the contiguous copy.
"""

from __future__ import annotations

import pytest
import torch

from common.attention.reference import paged_attention_reference, write_kv_reference
from tests.kernels.paged_cases import build_case, dense_causal_attention


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size",
    [(4, 4, 16), (4, 2, 8), (6, 2, 16), (8, 1, 32)],
    ids=["mha", "gqa2-bs8", "gqa3", "mqa-bs32"],
)
def test_reference_matches_dense_causal_attention(num_heads, num_kv_heads, block_size):
    head_dim = 16
    # decode, prefill from 0, chunk after a mid-block prefix, chunk after a block-aligned prefix,
    # verification (k + 1 = 4 tokens), and an idle sequence with no query this step.
    query_lens = [1, 13, 5, 7, 4, 0]
    seq_lens = [21, 13, 5 + 11, 7 + 2 * block_size, 30, 9]
    query, kc, vc, meta, keys, values = build_case(
        query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=block_size
    )
    scale = head_dim**-0.5
    out = paged_attention_reference(query, kc, vc, meta, scale)
    start = 0
    for q_len, k, v in zip(query_lens, keys, values):
        if q_len:
            expected = dense_causal_attention(query[start : start + q_len], k, v, scale)
            torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=2e-5, rtol=2e-5)
        start += q_len


def test_write_kv_reference_places_tokens_at_their_slots():
    block_size, kvh, d = 4, 2, 8
    kc = torch.zeros(5, block_size, kvh, d)
    vc = torch.zeros(5, block_size, kvh, d)
    key = torch.randn(3, kvh, d)
    value = torch.randn(3, kvh, d)
    slots = torch.tensor([0, 9, 19])  # block 0 slot 0, block 2 slot 1, block 4 slot 3
    write_kv_reference(key, value, kc, vc, slots)
    for t, (b, o) in enumerate([(0, 0), (2, 1), (4, 3)]):
        assert torch.equal(kc[b, o], key[t]) and torch.equal(vc[b, o], value[t])
    assert int((kc != 0).any(dim=(2, 3)).sum()) == 3
