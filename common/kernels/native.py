"""Builds and loads the project's C++ CPU kernels (small_gemm.cpp, cpu_decoder.cpp, sample_rows.cpp) through ctypes.

Each is compiled on first use with the system C++ compiler (a second or two; no torch headers)
into a per-user cache, named by a hash of its sources and flags, and loaded once per process.
Every kernel has two builds (VARIANTS): "avx2" (-mavx2 -mfma: any x86-64 CPU since ~2013) and
"avx512" (AVX-512 F/BW/VL/DQ: 16-wide vectors and 32 registers, so larger register tiles). A
process loads "avx512" when the CPU has those extensions and "avx2" otherwise, or the one that
`TANDEM_CPU_GEMM` names. Everything that uses them falls back to PyTorch when they cannot be had:
no compiler, no AVX2/FMA, not x86, or `TANDEM_CPU_GEMM=off`.
"""

from __future__ import annotations

import ctypes
import functools
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
from typing import TypeVar

import torch

from common.config import CPU_GEMM_ENV, KERNEL_CACHE_ENV

logger = logging.getLogger(__name__)
T = TypeVar("T")

HERE = Path(__file__).resolve().parent
HEADERS = ("gemm_tiles.h", "vector_math.h")  # included by the kernels: part of each build's hash
KERNELS = ("small_gemm.cpp", "cpu_decoder.cpp", "sample_rows.cpp")  # what an image prebuilds (Dockerfile)
FLAGS = ["-O3", "-fPIC", "-shared", "-std=c++17", "-fopenmp"]  # OpenMP: the threads (cpu_decoder.cpp)
# The instruction sets of each build; gemm_tiles.h picks its tiles by __AVX512F__.
VARIANTS = {
    "avx2": ["-mavx2", "-mfma"],
    "avx512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")  # /proc/cpuinfo names of what "avx512" uses


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


@functools.cache
def cpu_has_avx512() -> bool:
    """Whether this CPU (and OS) runs the "avx512" build: /proc/cpuinfo's flags on Linux (the kernel
    hides them when the OS does not save the zmm registers), else torch's own detection."""
    flags = _cpuinfo("flags")
    if flags is not None:
        return set(AVX512_FLAGS) <= set(flags.split())
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@functools.cache
def cpu_vendor() -> str:
    """"amd", "intel", or "" where unknown (/proc/cpuinfo's vendor_id). The kernels' crossovers with
    MKL depend on it: MKL runs its fastest code on Intel CPUs, and on an AMD CPU with AVX-512 the
    builds here stay ahead of it to far larger batches (small_gemm.py, cpu_decoder.py)."""
    return {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(_cpuinfo("vendor_id") or "", "")


def _cpuinfo(field: str) -> str | None:
    """The first value of `field` in /proc/cpuinfo, or None (not Linux, or no such field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def prefetch_to_l2() -> bool:
    """Whether the GEMM tiles prefetch the next weight rows into L2 rather than L1 (gemm_tiles.h):
    on AMD CPUs; Intel keeps L1, what the tiles were tuned with there."""
    return cpu_vendor() == "amd"


def rows_in_turn() -> bool:
    """Whether one, two and four rows of x read the weight rows in turn instead of the tiles
    (gemm_tiles.h, the same bits either way): on AMD CPUs, where they stream faster; on Intel the
    tiles win at every count."""
    return cpu_vendor() == "amd"


@functools.cache
def tiles_in_cache() -> bool:
    """Whether few-row products over weights that stay in cache take the register tiles instead of
    the weight rows in turn (gemm_tiles.h; the same bits either way): on AMD CPUs without AVX-512
    (Zen 2 EPYC, one row in cache: the tiles 1.45-2x faster at K = 128-576). With AVX-512 (Zen 4
    EPYC, 2026-12-07) the rows in turn stay ahead in cache too: the tiny model's 1024 x 128 head
    at one row 7.6 against 10.2 us, its decode step (kernel_ab) 0.907x at batch 1 on the tiles."""
    return rows_in_turn() and not cpu_has_avx512()


def tuned(table: dict[str, T], variant: str, default: T) -> T:
    """table's entry for `variant` on this CPU's vendor ("avx512/amd"), else for `variant`."""
    return table.get(f"{variant}/{cpu_vendor()}", table.get(variant, default))


def chosen_variant() -> tuple[str, str]:
    """(the build this process loads, ""), or ("", why none): CPU_GEMM_ENV's "avx2" / "avx512" when
    set to one (a CPU without AVX-512 refuses "avx512": the kernels would fault), else the widest
    build this CPU runs."""
    setting = os.environ.get(CPU_GEMM_ENV, "auto").lower()
    if setting not in ("auto", "off", *VARIANTS):  # read inside a forward pass: warn, do not fail it
        logger.warning("%s=%r is none of auto, off, %s: taken as auto", CPU_GEMM_ENV, setting, ", ".join(VARIANTS))
        setting = "auto"
    if setting == "off":
        return "", f"disabled by {CPU_GEMM_ENV}=off"
    if setting == "auto":
        setting = "avx512" if cpu_has_avx512() else "avx2"
    why = variant_unsupported(setting)
    return ("", f"{setting}: {why}") if why else (setting, "")


def avx2_on_avx512(variant: str) -> bool:
    """The AVX2 build forced onto an AVX-512 CPU, where MKL runs AVX-512 code: the kernels'
    crossovers with MKL come much sooner there (small_gemm.py, cpu_decoder.py)."""
    return variant == "avx2" and cpu_has_avx512()


def variant_unsupported(variant: str) -> str:
    """Empty when this CPU can run `variant`'s build, else why not."""
    why = cpu_unsupported()
    if not why and variant == "avx512" and not cpu_has_avx512():
        why = f"CPU lacks {'/'.join(AVX512_FLAGS)}"
    return why


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++, c++ or clang++ on PATH."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def require_compiler() -> str:
    """compiler(), or RuntimeError when there is none."""
    cxx = compiler()
    if not cxx:
        raise RuntimeError("no C++ compiler (g++/c++/clang++) on PATH")
    return cxx


def build(source: str, out_dir: Path | None = None, variant: str = "avx2") -> Path:
    """Compiles HERE/source for `variant` (if not cached) and returns the shared library's path.
    Compiling needs no support from this CPU: an image built on any x86-64 holds both builds."""
    flags = FLAGS + VARIANTS[variant]
    src = HERE / source
    text = src.read_bytes() + b"".join((HERE / h).read_bytes() for h in HEADERS)
    cxx = require_compiler()
    digest = hashlib.sha256(text + " ".join(flags).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{src.stem}-{variant}-{digest}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders (several services starting at
    # once) each produce a complete file and the last rename wins.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, "-o", tmp, str(src)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class NativeFunction:
    """One C function of one kernel library, built and loaded on first use; False-y when it cannot be.

    get() is the build chosen for this process (chosen_variant); get(variant) loads a given build
    beside it (the benchmarks and tests compare them)."""

    def __init__(self, source: str, symbol: str, declare: Callable[[ctypes._CFuncPtr], None]) -> None:
        self.source, self.symbol, self._declare = source, symbol, declare
        self._lock = threading.Lock()
        self._fn = None  # the chosen build's function, or False once loading failed
        self._builds: dict[str, tuple] = {}  # variant -> (function or False, why not)
        self.reason = ""  # why the chosen build is unavailable
        self.variant = ""  # the chosen build once loaded ("" when none is)

    def get(self, variant: str | None = None):
        """The C function, or False; decided once per process."""
        if variant is None and self._fn is not None:  # asked on every call: no lock once decided
            return self._fn
        with self._lock:
            if variant is not None:
                if variant not in self._builds:
                    self._builds[variant] = self._load(variant)
                return self._builds[variant][0]
            if self._fn is None:
                variant, why = chosen_variant()
                if not variant:
                    logger.info("CPU kernel %s unavailable (%s); using torch", self.symbol, why)
                fn, why = self._load(variant) if variant else (False, why)
                self.variant, self.reason = (variant if fn else ""), why
                self._fn = fn  # last: readers without the lock see variant set once _fn is
            return self._fn

    def reason_for(self, variant: str | None) -> str:
        """Why get(variant) is False ("" when it is not, or was not asked for yet)."""
        return self.reason if variant is None else self._builds.get(variant, (None, ""))[1]

    def forget(self) -> None:
        """Decide again on the next get() (after CPU_GEMM_ENV changed: tests)."""
        with self._lock:
            self._fn, self.reason, self.variant = None, "", ""

    def _load(self, variant: str):
        """(the function of `variant`'s build, "") or (False, why not)."""
        why = variant_unsupported(variant)
        if not why:
            try:
                lib = ctypes.CDLL(str(build(self.source, variant=variant)))
                fn = getattr(lib, self.symbol)
                self._declare(fn)
                lib.tandem_set_prefetch_l2(ctypes.c_int(int(prefetch_to_l2())))
                # Absent only from libraries built from older sources (kernel_ab's base revision).
                set_rows_in_turn = getattr(lib, "tandem_set_rows_in_turn", None)
                if set_rows_in_turn is not None:
                    set_rows_in_turn(ctypes.c_int(int(rows_in_turn())))
                return fn, ""
            except Exception as e:  # noqa: BLE001 - any build/load failure means "use torch"
                why = str(e)
        logger.info("CPU kernel %s (%s) unavailable (%s); using torch", self.symbol, variant, why)
        return False, why
