"""Structured outputs on a real instruct model (issue 12, acceptance 1): SmolLM2-135M-Instruct
behind a disaggregated cluster, the official openai client, 20 seeded sampled json_schema
requests at temperature 1.0, each validated with jsonschema; a choice constraint holds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS, kv_usage, openai_client, parallel, start_secure_cluster, wait_for
from tests.structured.test_structured_engine import PERSON

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def cluster(smollm2_model: Path, redis_url: str, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        smollm2_model, dev_certs, mode="disaggregated", num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url,
        extra_args=ENGINE_ARGS, run_dir=str(tmp_path_factory.mktemp("smollm2-structured")),
    ) as cluster:  # fmt: skip
        yield cluster


def test_smollm2_json_schema_20_seeded(cluster: Cluster) -> None:
    client = openai_client(cluster, timeout=300)
    model = client.models.list().data[0].id

    def ask(seed: int):
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=RESPONSE_FORMAT, temperature=1.0, seed=seed, max_tokens=150,
        )  # fmt: skip

    people = []
    for reply in parallel(ask, range(20), workers=10):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        person = json.loads(choice.message.content)
        jsonschema.validate(person, PERSON)
        people.append(person)
    assert len({p["name"] for p in people}) > 1

    options = ["Paris", "London", "Rome"]
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], temperature=1.0,
        seed=0, max_tokens=10, extra_body={"guided_choice": options},
    )  # fmt: skip
    assert reply.choices[0].message.content in options and reply.choices[0].finish_reason == "stop"
    assert wait_for(lambda: all(u.used == 0 and u.idle for u in kv_usage(cluster).values()), timeout_s=30)
