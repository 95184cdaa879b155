"""The committed stubs match the protos, import cleanly, and every field and rpc is documented."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "protos"))
import generate  # noqa: E402  (protos/generate.py)

MODULES = ("common", "generation", "decode", "kv_transfer", "prefill", "draft")


def test_committed_stubs_are_up_to_date(tmp_path):
    fresh = generate.generate(tmp_path)
    assert fresh, "protoc produced nothing"
    stale = []
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = REPO / rel
        if not committed.exists() or committed.read_bytes() != path.read_bytes():
            stale.append(str(rel))
    committed_names = {p.name for p in (REPO / "tandem" / "v1").glob("*_pb2*.py*")}
    extra = committed_names - {p.name for p in fresh}
    assert not stale and not extra, (
        f"stale stubs {stale}, stubs without a proto {sorted(extra)}: run `.venv/bin/python protos/generate.py`"
    )


@pytest.mark.parametrize("name", MODULES)
def test_stubs_import(name):
    pb2 = importlib.import_module(f"tandem.v1.{name}_pb2")
    importlib.import_module(f"tandem.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "tandem.v1"


def test_services_and_methods():
    from tandem.v1 import decode_pb2, draft_pb2, generation_pb2, kv_transfer_pb2, prefill_pb2

    def methods(pb2, service):
        desc = pb2.DESCRIPTOR.services_by_name[service]
        return {m.name: (m.client_streaming, m.server_streaming) for m in desc.methods}

    assert methods(generation_pb2, "Generation") == {
        "Generate": (False, True), "Complete": (False, False), "Tokenize": (False, False), "Detokenize": (False, False),
        "ListModels": (False, False), "Abort": (False, False),
    }  # fmt: skip
    assert methods(decode_pb2, "Decode") == {
        "Reserve": (False, False), "ReserveAndHold": (False, True), "Generate": (False, True), "Abort": (False, False),
        "GetLoad": (False, False),
    }  # fmt: skip
    assert methods(kv_transfer_pb2, "KVTransfer") == {"Handshake": (False, False), "PushKV": (True, False)}
    assert methods(prefill_pb2, "Prefill") == {"Prefill": (True, True), "Abort": (False, False), "GetLoad": (False, False)}
    assert methods(draft_pb2, "Draft") == {
        "GetInfo": (False, False), "Propose": (False, True), "Release": (False, False), "GetLoad": (False, False),
    }  # fmt: skip


@pytest.mark.parametrize("name", MODULES)
def test_every_field_and_rpc_is_commented(name):
    """A field, enum value or rpc line must have a comment on the line(s) right above it or at its end."""
    lines = (REPO / "protos" / "tandem" / "v1" / f"{name}.proto").read_text().splitlines()
    declaration = re.compile(r"^\s*(rpc\s+\w+|(optional\s+|repeated\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;|[A-Z0-9_]+\s*=\s*\d+\s*;)")
    undocumented = []
    for i, line in enumerate(lines):
        if not declaration.match(line):
            continue
        above = lines[i - 1].strip() if i else ""
        if "//" in line or above.startswith("//"):
            continue
        undocumented.append(f"{name}.proto:{i + 1}: {line.strip()}")
    assert not undocumented, "\n".join(undocumented)
