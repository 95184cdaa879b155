"""Small-batch float32 linear layers on x86 CPUs: a compiled AVX2 / AVX-512 kernel, called through ctypes.

At decode and speculative-verification batch sizes (a handful of rows) a linear layer is one
stream over its weights. MKL's sgemm handles that poorly on some CPUs (it re-reads the weights
per row up to 3 rows and then runs a slow small-M path), which made a 5-token verification pass
cost ~3x a 1-token step on the project's machine. `small_gemm.cpp` reads each weight row once
for all the rows of the batch. It is built on first use with the system C++ compiler (about a
second; no torch headers) into a per-user cache, for AVX-512 where the CPU has it and for AVX2
elsewhere (native.py; `TANDEM_CPU_GEMM=avx2` forces the AVX2 build), and everything falls back
to `F.linear` when it cannot be: no compiler, no AVX2/FMA, not x86, or `TANDEM_CPU_GEMM=off`.

Used only where it wins (measured, benchmarks/cpu_gemm.py): float32 CPU tensors with at most
max_rows() rows, which depends on the build and on how good MKL is on the CPU. Larger batches
(prefill, big decode batches) keep MKL, which is faster there.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from common.kernels import native

# Row counts above which MKL's blocked sgemm is as fast or faster (benchmarks/cpu_gemm.py, one and
# two threads). The crossover follows the build and how fast MKL is on the CPU: on the Intel Xeon
# that the AVX-512 build was tuned on MKL runs AVX-512 code (~160 GFLOP/s on one core at 128 rows),
# on the AMD EPYC the AVX2 build was tuned on it was far slower.
MAX_ROWS_BY_BUILD = {  # by build, or "build/vendor" where the vendor moves the crossover (native.tuned)
    "avx512": 32,  # Intel Xeon (Sapphire Rapids class), 2026-12-01: 1.10x / 1.17x MKL at 32 rows (2 / 1 threads), 0.96x / 1.05x at 40
    # AMD EPYC with AVX-512 (Zen 4 class), 2026-12-02, one thread: 1.18x / 1.17x MKL at 64 / 96 rows, 1.06x at 128
    "avx512/amd": 96,
    "avx2": 64,  # a CPU without AVX-512 (the AMD EPYC of 2026-11-29: crossover 64-96 rows)
}
MAX_ROWS_AVX2_ON_AVX512 = 12  # TANDEM_CPU_GEMM=avx2 on that Xeon: 1.4x MKL at 12 rows, 0.96x / 1.09x at 16
MAX_ROWS = max(MAX_ROWS_BY_BUILD.values())  # no build takes more rows


def _declare(fn) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int


_kernel = native.NativeFunction("small_gemm.cpp", "tandem_small_gemm", _declare)
# bfloat16 weights, float32 inputs and math (EngineConfig.weight_dtype): the same tiles, half the bytes.
_kernel_bf16 = native.NativeFunction("small_gemm.cpp", "tandem_small_gemm_bf16", _declare)
# bf16 weights take the kernel up to BF16_MAX_ROWS (or the build's max_rows(), if fewer); past it
# F.linear runs on a float32 copy of the weights made per call. AMD EPYC (Zen 3), AVX2 build,
# SmolLM2's four linear layers, 2 threads, kernel time / copy + MKL time: 0.89 / 0.90 / 0.99 at
# 16 / 32 / 48 rows, 1.41 at 64, 1.69 at 96.
BF16_MAX_ROWS = 48
cache_dir = native.cache_dir


def build(out_dir: Path | None = None, variant: str = "avx2") -> Path:
    """Compiles the kernel's `variant` build (if not cached) and returns the shared library's path."""
    return native.build("small_gemm.cpp", out_dir, variant)


def _load():
    return _kernel.get()


def max_rows() -> int:
    """Rows up to which linear() takes the process's kernel build (0 when there is none)."""
    _kernel.get()  # decides the build (once per process: then a plain attribute read)
    variant = _kernel.variant
    if native.avx2_on_avx512(variant):
        return MAX_ROWS_AVX2_ON_AVX512
    return native.tuned(MAX_ROWS_BY_BUILD, variant, 0)


def available() -> bool:
    return bool(_load())


def unavailable_reason() -> str:
    _load()
    return _kernel.reason


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               variant: str | None = None) -> torch.Tensor:  # fmt: skip
    """y = x @ weight.T + bias with the compiled kernel; x [M, K] float32, weight [N, K] float32 or
    bfloat16, CPU. `variant` ("avx2" / "avx512") picks a build; None is the process's own
    (native.chosen_variant)."""
    kernel = _kernel_bf16 if weight.dtype == torch.bfloat16 else _kernel
    fn = kernel.get(variant)
    if not fn:
        raise RuntimeError(f"small GEMM kernel ({variant or 'chosen build'}) unavailable: {kernel.reason_for(variant)}")
    return _run(fn, x, weight, bias, cached=False)


def _run(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cached: bool) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous().data_ptr()
    streamed = not (cached and native.tiles_in_cache())
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), b, y.data_ptr(), n, m, n, k, torch.get_num_threads(), streamed)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cached: bool = False) -> torch.Tensor:
    """F.linear, taking the compiled kernel for small float32 CPU batches. bfloat16 weights with
    float32 inputs (weights stored in bf16, math in float32) are widened: by the kernel as it loads
    them, or into a float32 copy for F.linear where the kernel does not take the batch.

    `cached`: the caller knows the weights stay in cache from one call to the next (a small
    model's whole working set does), so where native.tiles_in_cache() few rows take the register
    tiles rather than one weight row at a time (gemm_tiles.h). The same bits either way."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if weight.dtype == torch.bfloat16 and x.dtype == torch.float32:
        return _linear_bf16(x, weight, bias, rows, cached)
    if (
        0 < rows <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        fn = _load()  # last: a CUDA or bf16 run never builds the kernel
        if fn and rows <= max_rows():
            return _run_rows(fn, x, weight, bias, rows, cached)
    return F.linear(x, weight, bias)


def _run_rows(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
              cached: bool) -> torch.Tensor:  # fmt: skip
    """_run over x's leading dims flattened to `rows`, shaped back as F.linear's output."""
    out = _run(fn, x.reshape(rows, x.shape[-1]), weight, bias, cached)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                 cached: bool) -> torch.Tensor:  # fmt: skip
    if (
        0 < rows <= BF16_MAX_ROWS
        and x.device.type == "cpu"
        and (bias is None or bias.dtype == torch.float32)
        and not torch.is_grad_enabled()
    ):
        fn = _kernel_bf16.get()
        if fn and rows <= max_rows():
            return _run_rows(fn, x, weight, bias, rows, cached)
    return F.linear(x, weight.float(), None if bias is None else bias.float())
