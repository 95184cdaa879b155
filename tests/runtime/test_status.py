"""`tandem status`: text and JSON rendering, and main() against a real registry."""

from __future__ import annotations

import json

import pytest

from services.runtime.redis_server import RedisServerProcess
from services.runtime.registry import Registry, WorkerInfo
from services.runtime.routing import RecentPrefixes
from services.runtime.status import main, render_status

NOW = 1_000_000.0


def sample_workers() -> list[WorkerInfo]:
    prefixes = RecentPrefixes()
    prefixes.add([1, 2, 3])
    return [
        WorkerInfo("d-0", "decode", "127.0.0.1:50071", "tiny", kv_blocks_free=416, kv_blocks_total=512,
                   num_running=3, num_waiting=1, updated_at=NOW - 0.25,
                   extra={"spec_acceptance_rate": 0.72, "spec_mean_accepted_len": 2.9, "spec_draft_token_cost": 0.31,
                          **prefixes.to_extra()}),
        WorkerInfo("p-0", "prefill", "127.0.0.1:50061", "tiny", kv_blocks_free=512, kv_blocks_total=512,
                   queued_tokens=1800, updated_at=NOW - 90),
        WorkerInfo("g-0", "gateway", "127.0.0.1:50051", "tiny", updated_at=NOW - 1.0),
    ]


def test_render_text_table() -> None:
    text = render_status(sample_workers(), as_json=False, now=NOW, cluster="tandem")
    lines = text.splitlines()
    assert lines[0] == "cluster 'tandem': 1 gateway, 1 prefill, 1 decode"
    assert lines[1].split()[:4] == ["ROLE", "ID", "ADDRESS", "MODEL"]
    assert [line.split()[0] for line in lines[2:]] == ["gateway", "prefill", "decode"]
    decode_line = lines[4]
    for cell in ("d-0", "127.0.0.1:50071", "96/512 (19%)", "0.2s", "0.72 (2.9 tok) c=0.31"):
        assert cell in decode_line
    assert "1800" in lines[3] and "2m" in lines[3] and lines[3].endswith("-")
    # Columns line up: every row's ADDRESS starts where the header's does.
    col = lines[1].index("ADDRESS")
    assert all(line[col:].startswith("127.0.0.1:") for line in lines[2:])


def test_render_empty() -> None:
    assert render_status([], as_json=False) == "no workers registered"
    assert json.loads(render_status([], as_json=True))["workers"] == []


def test_render_json() -> None:
    doc = json.loads(render_status(sample_workers(), as_json=True, now=NOW, cluster="tandem"))
    assert doc["cluster"] == "tandem" and doc["num_workers"] == 3
    assert doc["workers_by_role"] == {"gateway": 1, "prefill": 1, "decode": 1, "draft": 0}
    decode = doc["workers"][2]
    assert decode["role"] == "decode" and decode["worker_id"] == "d-0"
    assert decode["kv_blocks_used"] == 96 and decode["kv_usage"] == pytest.approx(96 / 512, abs=1e-4)
    assert decode["heartbeat_age_s"] == pytest.approx(0.25)
    assert decode["extra"] == {"spec_acceptance_rate": 0.72, "spec_mean_accepted_len": 2.9, "spec_draft_token_cost": 0.31,
                               "num_prefix_hashes": 3}


def test_main_reads_the_registry(redis_url: str, cluster: str, capsys: pytest.CaptureFixture[str]) -> None:
    with Registry(redis_url, cluster) as registry:
        for info in sample_workers():
            registry.register(info, ttl_s=10)
    assert main(["--redis-url", redis_url, "--cluster", cluster, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [w["worker_id"] for w in doc["workers"]] == ["g-0", "p-0", "d-0"]
    assert main(["--redis-url", redis_url, "--cluster", cluster]) == 0
    assert "96/512 (19%)" in capsys.readouterr().out


def test_main_errors_are_clear(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main([]) == 2
    assert "--redis-url" in capsys.readouterr().err
    server = RedisServerProcess()
    server.start()
    url = server.url
    server.close()
    assert main(["--redis-url", url, "--cluster", "x"]) == 1
    err = capsys.readouterr().err
    assert "cannot read cluster 'x'" in err and "unreachable" in err
