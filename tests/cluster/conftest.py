"""One disaggregated cluster (1 prefill, 2 decode, gateway) shared by every test of this folder.

Starting a cluster costs ~10-20 s of CPU on two shared cores, so tests share this one and
measure deltas (metrics) or return-to-baseline (KV pools) rather than absolute numbers. Tests
that must break a cluster (Redis outage, mismatched workers) start their own.

Like every test cluster it is secure: an API key on the gateway, mTLS on every internal channel
and TLS on the public ports (cluster_helpers.start_secure_cluster); test_cluster_secure.py checks
that it really refuses plaintext and keyless clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS, start_secure_cluster


@pytest.fixture(scope="package")
def disagg(tiny_model, redis_url: str, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, mode="disaggregated", num_prefill=1, num_decode=2, http_port=0, grpc_port=0,
        redis_url=redis_url, extra_args=ENGINE_ARGS, run_dir=str(tmp_path_factory.mktemp("disagg")),
    ) as cluster:  # fmt: skip
        yield cluster
