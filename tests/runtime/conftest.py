"""Redis fixtures for the runtime tests (the lead may lift them into tests/conftest.py).

Tests use $REDIS_URL when it is set, else a private redis-server started for the session; never
a system Redis on 6379. Each test gets its own cluster namespace, deleted afterwards, so tests
can share one server (and a shared $REDIS_URL) without seeing each other's keys.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from services.runtime.redis_server import RedisServerProcess, redis_for_tests
from services.runtime.registry import Registry


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with redis_for_tests() as url:
        yield url


@pytest.fixture
def cluster(redis_url: str) -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:10]}"
    yield name
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{name}:*", count=500))
        if keys:
            client.delete(*keys)
    except redis.RedisError:
        pass  # a test that stopped its own server leaves nothing on the shared one
    finally:
        client.close()


@pytest.fixture
def registry(redis_url: str, cluster: str) -> Iterator[Registry]:
    with Registry(redis_url, cluster) as reg:
        yield reg


@pytest.fixture
def private_redis() -> Iterator[RedisServerProcess]:
    """A server of this test's own, even when $REDIS_URL is set: outage tests stop it."""
    with RedisServerProcess() as server:
        yield server
