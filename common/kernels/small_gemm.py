"""Small-batch float32 linear layers on x86 CPUs: a compiled AVX2 kernel, called through ctypes.

At decode and speculative-verification batch sizes (a handful of rows) a linear layer is one
stream over its weights. MKL's sgemm handles that poorly on some CPUs (it re-reads the weights
per row up to 3 rows and then runs a slow small-M path), which made a 5-token verification pass
cost ~3x a 1-token step on the project's machine. `small_gemm.cpp` reads each weight row once
for all the rows of the batch. It is built on first use with the system C++ compiler (about a
second; no torch headers) into a per-user cache, and everything falls back to `F.linear` when
it cannot be: no compiler, no AVX2/FMA, not x86, or `TANDEM_CPU_GEMM=off`.

Used only where it wins (measured, benchmarks/cpu_gemm.py): float32 CPU tensors with at most
`MAX_ROWS` rows. Larger batches (prefill, big decode batches) keep MKL, which is faster there.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from common.config import CPU_GEMM_ENV, KERNEL_CACHE_ENV

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_gemm.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17"]
MAX_ROWS = 64  # above this MKL's blocked GEMM is as fast or faster (benchmarks/cpu_gemm.py)

_lock = threading.Lock()
_fn = None  # the loaded C function, or False once loading has failed
_reason = ""


def cache_dir() -> Path:
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


def _cpu_supported() -> str:
    """Empty when this CPU can run the kernel, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", or "DEFAULT"
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} lacks AVX2"
    return ""


def build(out_dir: Path | None = None) -> Path:
    """Compiles the kernel (if not cached) and returns the shared library's path."""
    source = SOURCE.read_bytes()
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++/c++/clang++) on PATH")
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"small_gemm-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders (several services starting at
    # once) each produce a complete file and the last rename wins.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lpthread"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load():
    """The C function, or False when it cannot be had; decided once per process."""
    global _fn, _reason
    if _fn is not None:  # every linear layer asks: no lock once decided
        return _fn
    with _lock:
        if _fn is not None:
            return _fn
        # CPU_GEMM_ENV: "off" disables the kernel; anything else (default "auto") allows it.
        off = os.environ.get(CPU_GEMM_ENV, "auto").lower() == "off"
        why = f"disabled by {CPU_GEMM_ENV}=off" if off else _cpu_supported()
        if not why:
            try:
                fn = ctypes.CDLL(str(build())).tandem_small_gemm
                p, i64 = ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, ctypes.c_int]
                fn.restype = ctypes.c_int
                _fn = fn
                return _fn
            except Exception as e:  # noqa: BLE001 - any build/load failure means "use F.linear"
                why = str(e)
        _fn, _reason = False, why
        logger.info("small-batch CPU GEMM kernel unavailable (%s); using torch's linear", why)
        return _fn


def available() -> bool:
    return bool(_load())


def unavailable_reason() -> str:
    _load()
    return _reason


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias with the compiled kernel; x [M, K], weight [N, K], float32, CPU."""
    fn = _load()
    if not fn:
        raise RuntimeError(f"small GEMM kernel unavailable: {_reason}")
    return _run(fn, x, weight, bias)


def _run(fn, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous().data_ptr()
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), b, y.data_ptr(), n, m, n, k, torch.get_num_threads())
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, taking the compiled kernel for small float32 CPU batches."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (
        0 < rows <= MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        fn = _load()  # last: a CUDA or bf16 run never builds the kernel
        if fn:
            out = _run(fn, x.reshape(rows, x.shape[-1]), weight, bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
