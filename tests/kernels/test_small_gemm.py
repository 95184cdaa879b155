"""The compiled small-batch CPU GEMM: builds here, equals F.linear, and falls back cleanly."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from common.config import CPU_GEMM_ENV, KERNEL_CACHE_ENV
from common.kernels import native
from common.kernels import small_gemm as sg

CAN_BUILD = native.cpu_unsupported() == "" and shutil.which("g++") is not None


def test_kernel_is_available_on_this_machine():
    # CI runs on x86-64 with g++: the kernel must really be in use there, not silently skipped.
    if not CAN_BUILD:
        assert not sg.available() and sg.unavailable_reason()
        return
    assert sg.available(), sg.unavailable_reason()


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16])
@pytest.mark.parametrize("k,n", [(768, 1280), (64, 7), (3072, 96), (13, 5), (8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_linear(rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = sg.small_gemm(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
def test_threads_split_columns_identically():
    x, w = torch.randn(5, 512), torch.randn(1030, 512)  # N not a multiple of the split
    one = sg.small_gemm(x, w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = sg.small_gemm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is computed by one thread, in the same order


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
def test_linear_dispatch_shapes_and_strides():
    w, b = torch.randn(48, 32), torch.randn(48)
    x3 = torch.randn(2, 3, 32)  # leading dims are flattened and restored
    torch.testing.assert_close(sg.linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)
    xt = torch.randn(32, 4).t()  # rows not contiguous
    torch.testing.assert_close(sg.linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-4)
    big = torch.randn(sg.MAX_ROWS + 1, 32)  # beyond the kernel's range: torch's own linear
    assert torch.equal(sg.linear(big, w, b), F.linear(big, w, b))
    half = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(sg.linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
def test_build_into_fresh_cache_dir(tmp_path):
    lib = sg.build(tmp_path)
    assert lib.exists() and lib.parent == tmp_path
    assert sg.build(tmp_path) == lib  # cached: same file, no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary files left


def test_switch_off_falls_back_to_torch(tmp_path):
    code = (
        "import torch, torch.nn.functional as F\n"
        "from common.kernels import small_gemm as sg\n"
        "x, w = torch.randn(3, 16), torch.randn(8, 16)\n"
        "assert not sg.available() and 'TANDEM_CPU_GEMM' in sg.unavailable_reason()\n"
        "assert torch.equal(sg.linear(x, w), F.linear(x, w))\n"
    )
    env = {**os.environ, CPU_GEMM_ENV: "off", KERNEL_CACHE_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not any(tmp_path.iterdir())  # switched off: nothing was compiled


def test_missing_compiler_falls_back_to_torch(tmp_path):
    code = (
        "import torch, torch.nn.functional as F\n"
        "from common.kernels import small_gemm as sg\n"
        "x, w = torch.randn(3, 16), torch.randn(8, 16)\n"
        "assert not sg.available(), 'built without a compiler?'\n"
        "assert torch.equal(sg.linear(x, w), F.linear(x, w))\n"
    )
    env = {**os.environ, "PATH": str(tmp_path), "CXX": "", KERNEL_CACHE_ENV: str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
