"""Smoke test of benchmarks/decode_attention.py's harness: it still builds against cpu_decoder.cpp
(which it includes, calling attend_group directly) and each mode prints its two figures. It checks
that they are there and positive, never how fast they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import decode_attention  # noqa: E402
from common.kernels import native  # noqa: E402

pytestmark = pytest.mark.skipif(not native.cpu_has_avx512() or not native.compiler(),
                                reason="the harness is built with the AVX-512 flags and a C++ compiler")  # fmt: skip


def test_the_harness_builds_and_reports_every_mode(tmp_path):
    exe = decode_attention.build(tmp_path)
    for mode in decode_attention.MODES:
        out = subprocess.run([str(exe), "40", "3", mode], check=True, capture_output=True, text=True, timeout=120)
        us, gb_s = map(float, out.stdout.split())
        assert us > 0 and gb_s > 0
