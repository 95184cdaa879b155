"""Builds and loads the project's C++ CPU kernels (small_gemm.cpp, cpu_decoder.cpp) through ctypes.

Each is compiled on first use with the system C++ compiler (a second or two; no torch headers)
into a per-user cache, named by a hash of its sources and flags, and loaded once per process.
Everything that uses them falls back to PyTorch when they cannot be had: no compiler, no
AVX2/FMA, not x86, or `TANDEM_CPU_GEMM=off`.
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
from collections.abc import Callable
from pathlib import Path

import torch

from common.config import CPU_GEMM_ENV, KERNEL_CACHE_ENV

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
HEADERS = ("gemm_tiles.h",)  # included by every kernel: part of each build's hash
KERNELS = ("small_gemm.cpp", "cpu_decoder.cpp")  # what an image prebuilds (Dockerfile)
FLAGS = ["-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17"]


def cache_dir() -> Path:
    if os.environ.get(KERNEL_CACHE_ENV):
        return Path(os.environ[KERNEL_CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tandem" / "kernels"


def cpu_unsupported() -> str:
    """Empty when this CPU can run the kernels, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not x86-64 ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX2", "AVX512", or "DEFAULT"
    if capability not in ("AVX2", "AVX512"):
        return f"CPU capability {capability} lacks AVX2"
    return ""


def build(source: str, out_dir: Path | None = None) -> Path:
    """Compiles HERE/source (if not cached) and returns the shared library's path."""
    src = HERE / source
    text = src.read_bytes() + b"".join((HERE / h).read_bytes() for h in HEADERS)
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not compiler:
        raise RuntimeError("no C++ compiler (g++/c++/clang++) on PATH")
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{src.stem}-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders (several services starting at
    # once) each produce a complete file and the last rename wins.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", tmp, str(src), "-lpthread"],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class NativeFunction:
    """One C function of one kernel library, built and loaded on first use; False-y when it cannot be."""

    def __init__(self, source: str, symbol: str, declare: Callable[[ctypes._CFuncPtr], None]) -> None:
        self.source, self.symbol, self._declare = source, symbol, declare
        self._lock = threading.Lock()
        self._fn = None  # the loaded function, or False once loading failed
        self.reason = ""

    def get(self):
        """The C function, or False; decided once per process."""
        if self._fn is not None:  # asked on every call: no lock once decided
            return self._fn
        with self._lock:
            if self._fn is None:
                self._fn = self._load()
            return self._fn

    def _load(self):
        # CPU_GEMM_ENV: "off" disables the kernels; anything else (default "auto") allows them.
        off = os.environ.get(CPU_GEMM_ENV, "auto").lower() == "off"
        why = f"disabled by {CPU_GEMM_ENV}=off" if off else cpu_unsupported()
        if not why:
            try:
                fn = getattr(ctypes.CDLL(str(build(self.source))), self.symbol)
                self._declare(fn)
                return fn
            except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch"
                why = str(e)
        self.reason = why
        logger.info("CPU kernel %s unavailable (%s); using torch", self.symbol, why)
        return False
