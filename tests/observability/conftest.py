"""One traced cluster (gateway, prefill, decode, draft) exporting to a real OTLP receiver, shared
by this folder's tests (starting one costs ~15 s of the two shared cores). Secure, like every test
cluster (API key, mTLS between the services: trace context crosses mTLS channels)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS, PATIENT_DRAFT, PINNED_K, start_secure_cluster
from tests.observability.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="package")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="package")
def traced(tiny_model, redis_url: str, receiver: OtlpReceiver, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}  # fmt: skip
    with start_secure_cluster(
        tiny_model, dev_certs, draft_model=str(tiny_model), mode="disaggregated", http_port=0, grpc_port=0,
        redis_url=redis_url, extra_args=ENGINE_ARGS + PINNED_K + PATIENT_DRAFT, run_dir=str(tmp_path_factory.mktemp("traced")), env=env,
    ) as cluster:  # fmt: skip
        yield cluster
