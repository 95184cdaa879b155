"""A disaggregated cluster (1 prefill, 1 decode, gateway) for the OpenAI-surface tests of this folder.

Secure like every test cluster (API key on the gateway, mTLS between the services); the tiny
cluster's public port is plain HTTP (`--public-tls off`: TLS ended at an ingress or OpenShift
route, a common setup), so lm-eval's own HTTP client reaches it with just the key.

n == 1 requests take the prefill worker (prompt logprobs come from prefill); n > 1 requests run on
decode alone (LOCAL KV), so one cluster covers both paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS, openai_client, rest, start_secure_cluster

PUBLIC_PLAIN = ("--public-tls", "off")


@pytest.fixture(scope="package")
def disagg(tiny_model, redis_url: str, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, mode="disaggregated", num_prefill=1, num_decode=1, http_port=0, grpc_port=0,
        redis_url=redis_url, extra_args=(*ENGINE_ARGS, *PUBLIC_PLAIN), run_dir=str(tmp_path_factory.mktemp("openai")),
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="package")
def base_url(disagg: Cluster) -> str:
    return disagg.http_url


@pytest.fixture(scope="package")
def http(disagg: Cluster) -> Iterator[httpx.Client]:
    """Plain REST calls to the gateway (base_url set, the API key sent)."""
    with rest(disagg) as client:
        yield client


@pytest.fixture(scope="package")
def client(disagg: Cluster) -> openai.OpenAI:
    return openai_client(disagg)


@pytest.fixture(scope="package")
def model_id(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def one_decode_cluster(model: Path, redis_url: str, dev_certs: Path, tmp_path_factory, name: str,
                       mode: str = "disaggregated") -> Iterator[Cluster]:
    """A cluster with one decode worker (and, disaggregated, one prefill) for a real model's tests:
    secure throughout (HTTPS public port too: clients come from tests/cluster/cluster_helpers)."""
    with start_secure_cluster(
        model, dev_certs, mode=mode, num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url, extra_args=ENGINE_ARGS,
        run_dir=str(tmp_path_factory.mktemp(name)),
    ) as cluster:  # fmt: skip
        yield cluster
