"""Chained block hashes: full blocks only, chained, and identical in every process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common.kv_cache.prefix_hash import ROOT_HASH, compute_block_hashes, hash_block_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_full_blocks_only_and_chained():
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4)
    assert len(hashes) == 2  # the trailing 2 tokens form no full block
    assert hashes[0] == hash_block_tokens(None, tokens[0:4]) == hash_block_tokens(ROOT_HASH, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    assert compute_block_hashes(tokens[4:8], 4, parent_hash=hashes[0]) == hashes[1:]
    assert compute_block_hashes(tokens[:3], 4) == []


def test_same_block_different_prefix_differs():
    a = compute_block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = compute_block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]  # same tokens in block 1, different history
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(None, (1, 2)) == hash_block_tokens(None, [1, 2])


def test_pinned_values():
    # Hashes cross service boundaries (router affinity, KV transfer): changing the encoding is a
    # protocol change, so it must break this test.
    assert compute_block_hashes(list(range(10)), 4) == [15810094990363258763, 15860580587077587081]
    assert hash_block_tokens(None, [1, 2, 3]) == 3351146345649969386


def test_stable_across_processes():
    tokens = [7, 151643, 0, 42, 99999, 3, 3, 3, 12, 13, 14, 15, 16]
    code = (
        "import json, sys; from common.kv_cache.prefix_hash import compute_block_hashes; "
        f"print(json.dumps(compute_block_hashes({tokens!r}, 4)))"
    )
    expected = compute_block_hashes(tokens, 4)
    for seed in ("1", "12345"):  # different str-hash salts must not matter
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True, capture_output=True, text=True
        )
        assert json.loads(out.stdout) == expected
