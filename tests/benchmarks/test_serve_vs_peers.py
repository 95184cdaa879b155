"""Smoke test of benchmarks/serve_vs_peers.py's Tandem path: `tandem up` on the tiny random model,
one stream for ~3 s from the builtin client, one JSON row. It checks the figures are there and
sane, never how fast they are (the full comparison with the peers runs outside `make test`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_tandem_path_writes_a_sane_row(tiny_model, tmp_path):
    out = tmp_path / "serve_vs_peers.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_vs_peers.py"), "--models", str(tiny_model),
           "--servers", "tandem", "--streams", "1", "--duration", "3", "--client", "builtin", "--no-limits",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert "error" not in row, row
    assert (row["server"], row["streams"], row["client"]) == ("tandem", 1, "builtin")
    assert row["requests"] >= 1
    assert row["output_tok_s"] > 0
    assert 0 < row["ttft_p50_ms"] < 60_000
    assert row["ttft_p90_ms"] >= row["ttft_p50_ms"] and row["ttft_mean_ms"] > 0
    assert "TTFT p90 / mean ms:" in result["table"]
    assert 0 < row["itl_p50_ms"] < 60_000 and not math.isnan(row["itl_p50_ms"])
    assert "| Tandem |" in result["table"] and "machine" in result
