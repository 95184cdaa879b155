"""The compiled small-batch CPU GEMM: both builds (AVX2, AVX-512) build here, equal F.linear,
and fall back cleanly; the process takes the widest build its CPU runs unless told otherwise."""

from __future__ import annotations

import ctypes
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
    assert sg._kernel.variant == ("avx512" if native.cpu_has_avx512() else "avx2")


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 13, 16, 25, 40])
@pytest.mark.parametrize("k,n", [(768, 1280), (64, 7), (3072, 96), (13, 5), (8, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch_linear(kernel_variant, rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = sg.small_gemm(x, w, b)
    assert sg._kernel.variant == kernel_variant
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 40])
@pytest.mark.parametrize("k,n", [(768, 1280), (64, 7), (13, 5), (577, 33)])
def test_bf16_weights_match_their_float32_values(kernel_variant, rows, k, n):
    # bf16 storage, float32 math: the same result as float32 weights holding the rounded values.
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    got = sg.small_gemm(x, w, b)
    assert sg._kernel_bf16.variant == kernel_variant and got.dtype == torch.float32
    torch.testing.assert_close(got, F.linear(x, w.float(), b), rtol=1e-5, atol=1e-4 * k**0.5)
    # linear() takes the kernel up to BF16_MAX_ROWS rows, a float32 copy + F.linear past it.
    for m in (rows, sg.BF16_MAX_ROWS + 1):
        xm = torch.randn(m, k, generator=g)
        torch.testing.assert_close(sg.linear(xm, w, b), F.linear(xm, w.float(), b), rtol=1e-5, atol=1e-4 * k**0.5)


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
def test_threads_split_columns_identically(kernel_variant):
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
@pytest.mark.parametrize("k", [576, 77, 13])
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_a_rows_results_do_not_depend_on_the_batch_around_it(kernel_variant, k, weights):
    # 1, 2 and 4 rows read the weights in turn on AMD (native.rows_in_turn), other counts and other
    # CPUs run the tiles: every path sums each output in the same order, so a sequence decoded alone
    # and beside others (or resumed as a prompt) gets the same bits, and greedy or seeded sampling
    # cannot drift with its neighbours. Both settings are checked on any CPU.
    lib = ctypes.CDLL(str(native.build("small_gemm.cpp", variant=kernel_variant)))  # the library get() loaded
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(13, k, generator=g), torch.randn(40, k, generator=g).to(weights), torch.randn(40, generator=g)
    whole = sg.small_gemm(x, w, b)
    try:
        for on in (0, 1):
            lib.tandem_set_rows_in_turn(ctypes.c_int(on))
            for rows in (1, 2, 3, 4, 5, 7):
                assert torch.equal(sg.small_gemm(x[:rows], w, b), whole[:rows]), (on, rows)
    finally:
        lib.tandem_set_rows_in_turn(ctypes.c_int(int(native.rows_in_turn())))


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_cached_weights_give_the_same_bits(kernel_variant, weights, monkeypatch):
    # linear(cached=True): a small model's head, in cache, may take the tiles instead of the rows in
    # turn (native.tiles_in_cache: AMD without AVX-512): a speed choice, the same bits either way.
    lib = ctypes.CDLL(str(native.build("small_gemm.cpp", variant=kernel_variant)))
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(5, 128, generator=g), torch.randn(1030, 128, generator=g).to(weights)
    try:
        lib.tandem_set_rows_in_turn(ctypes.c_int(1))  # the streamed path reads the rows in turn on any CPU
        for tiles in (False, True):
            monkeypatch.setattr(native, "tiles_in_cache", lambda tiles=tiles: tiles)
            for rows in (1, 2, 4):
                assert torch.equal(sg.linear(x[:rows], w, cached=True), sg.linear(x[:rows], w)), (tiles, rows)
    finally:
        lib.tandem_set_rows_in_turn(ctypes.c_int(int(native.rows_in_turn())))


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
def test_linear_dispatch_shapes_and_strides(kernel_variant):
    w, b = torch.randn(48, 32), torch.randn(48)
    x3 = torch.randn(2, 3, 32)  # leading dims are flattened and restored
    torch.testing.assert_close(sg.linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)
    xt = torch.randn(32, 4).t()  # rows not contiguous
    torch.testing.assert_close(sg.linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-4)
    big = torch.randn(sg.MAX_ROWS + 1, 32)  # beyond the kernel's range: torch's own linear
    assert torch.equal(sg.linear(big, w, b), F.linear(big, w, b))
    limit = sg.max_rows()  # this build's crossover with MKL
    forced = kernel_variant == "avx2" and native.cpu_has_avx512()
    assert limit == (sg.MAX_ROWS_AVX2_ON_AVX512 if forced else native.tuned(sg.MAX_ROWS_BY_BUILD, kernel_variant, 0))
    past = torch.randn(limit + 1, 32)
    assert torch.equal(sg.linear(past, w, b), F.linear(past, w, b))
    half = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(sg.linear(half, w.bfloat16()), F.linear(half, w.bfloat16()))


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("variant", native.VARIANTS)
def test_build_into_fresh_cache_dir(tmp_path, variant):
    # Compiling either build needs no support from the CPU (the Docker image prebuilds both).
    lib = sg.build(tmp_path, variant)
    assert lib.exists() and lib.parent == tmp_path and variant in lib.name
    assert sg.build(tmp_path, variant) == lib  # cached: same file, no rebuild
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary files left


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("setting", ["avx2", "avx512", "AVX2", "bogus"])
def test_switch_picks_the_build(tmp_path, setting):
    code = (
        "import torch, torch.nn.functional as F\n"
        "from common.kernels import native, small_gemm as sg\n"
        "x, w = torch.randn(3, 16), torch.randn(8, 16)\n"
        "torch.testing.assert_close(sg.linear(x, w), F.linear(x, w))\n"
        "print(sg._kernel.variant or sg.unavailable_reason())\n"
    )
    env = {**os.environ, CPU_GEMM_ENV: setting, KERNEL_CACHE_ENV: str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    widest = "avx512" if native.cpu_has_avx512() else "avx2"
    if setting == "avx512" and widest == "avx2":  # forced onto a CPU without it: off, not a fault
        assert "avx512" in proc.stdout and "lacks" in proc.stdout
        assert not any(tmp_path.iterdir())
        return
    want = {"AVX2": "avx2", "bogus": widest}.get(setting, setting)
    assert proc.stdout.strip() == want
    assert [p.name.split("-")[1] for p in tmp_path.iterdir()] == [want]  # only that build was compiled
    if setting == "bogus":
        assert "taken as auto" in proc.stderr


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


def test_tuned_prefers_the_vendors_entry(monkeypatch):
    table = {"avx512": 32, "avx512/amd": 96, "avx2": 64}
    assert native.cpu_vendor.__wrapped__() in ("amd", "intel", "")  # reads /proc/cpuinfo without failing
    monkeypatch.setattr(native, "cpu_vendor", lambda: "amd")
    assert native.tuned(table, "avx512", 0) == 96
    assert native.tuned(table, "avx2", 0) == 64  # no AMD entry for this build: the build's own
    monkeypatch.setattr(native, "cpu_vendor", lambda: "intel")
    assert native.tuned(table, "avx512", 0) == 32
    assert native.tuned(table, "none", 0) == 0


@pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("source", native.KERNELS)
def test_prefetch_target_changes_no_result(source, kernel_variant):
    # Where the tiles prefetch (L1 or L2: native.prefetch_to_l2) is speed only: the same bits.
    lib = ctypes.CDLL(str(native.build(source, variant=kernel_variant)))  # the library get() loaded
    x, w, b = torch.randn(5, 300), torch.randn(70, 300), torch.randn(70)
    results = []
    for on in (0, 1, int(native.prefetch_to_l2())):
        lib.tandem_set_prefetch_l2(ctypes.c_int(on))
        results.append(sg.small_gemm(x, w, b, variant=kernel_variant))
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])
    torch.testing.assert_close(results[0], F.linear(x, w, b), rtol=1e-5, atol=1e-4)
