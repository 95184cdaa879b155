"""A disaggregated cluster (1 prefill, 1 decode, gateway) for the OpenAI-surface tests of this folder.

n == 1 requests take the prefill worker (prompt logprobs come from prefill); n > 1 requests run on
decode alone (LOCAL KV), so one cluster covers both paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.launcher.cluster import Cluster, start_cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS


@pytest.fixture(scope="package")
def disagg(tiny_model, redis_url: str, tmp_path_factory) -> Iterator[Cluster]:
    with start_cluster(
        tiny_model, mode="disaggregated", num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
        redis_url=redis_url, extra_args=ENGINE_ARGS, run_dir=str(tmp_path_factory.mktemp("openai")),
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="package")
def base_url(disagg: Cluster) -> str:
    return disagg.http_url


@pytest.fixture(scope="package")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="package")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def one_decode_cluster(model: Path, redis_url: str, tmp_path_factory, name: str,
                       mode: str = "disaggregated") -> Iterator[Cluster]:
    """A cluster with one decode worker (and, disaggregated, one prefill) for a real model's tests."""
    with start_cluster(
        model, mode=mode, num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url, extra_args=ENGINE_ARGS,
        run_dir=str(tmp_path_factory.mktemp(name)),
    ) as cluster:  # fmt: skip
        yield cluster
