"""Issue 4 end to end: `tandem up --draft-model` wires a draft worker into decode. Greedy output
through the speculating cluster equals transformers, the draft is used (draft = target: nearly
every draft token accepted), acceptance shows in `tandem status`, and no block leaks anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cancel_soak import run_soak
from tests.cluster.cluster_helpers import ENGINE_ARGS, PATIENT_DRAFT, PINNED_K, MAX_TOKENS, complete_ids, draft_sequences, kv_usage, openai_client, parallel, random_prompts, start_secure_cluster, wait_for, worker_metrics
from tests.engine.engine_helpers import hf_greedy

PROMPTS = random_prompts((7, 40, 90), seed=5)
# The draft's lease is the last resort for sequences nobody released: this long, only decode's
# releases can empty it while a test polls.
LONG_DRAFT_LEASE = ("--lease-seconds", "600")


@pytest.fixture(scope="module")
def speculating(tiny_model, redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, draft_model=str(tiny_model), mode="disaggregated", http_port=0, grpc_port=0,
        redis_url=redis_url, extra_args=ENGINE_ARGS + PINNED_K + PATIENT_DRAFT + LONG_DRAFT_LEASE, run_dir=str(tmp_path_factory.mktemp("spec")),
    ) as cluster:  # fmt: skip
        yield cluster


def _spec_counts(cluster: Cluster) -> tuple[float, float]:
    decode = worker_metrics(cluster, "decode")[0]
    return (decode.get("tandem_spec_decode_draft_tokens_total", 0.0),
            decode.get("tandem_spec_decode_accepted_tokens_total", 0.0))  # fmt: skip


def test_draft_cluster_greedy_exact_and_accepting(speculating: Cluster, tiny_model) -> None:
    # Decode finds the draft worker through its registry view (refreshed every second).
    assert wait_for(lambda: complete_ids(speculating, PROMPTS[0], max_tokens=4) and _spec_counts(speculating)[0] > 0,
                    timeout_s=30)  # fmt: skip
    drafted0, accepted0 = _spec_counts(speculating)
    outputs = parallel(lambda p: complete_ids(speculating, p, max_tokens=MAX_TOKENS * 2), PROMPTS)
    assert outputs == hf_greedy(tiny_model, PROMPTS, MAX_TOKENS * 2)
    drafted, accepted = _spec_counts(speculating)
    assert drafted > drafted0 and (accepted - accepted0) / (drafted - drafted0) >= 0.95

    status = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--json", "--redis-url", speculating.redis_url,
         "--cluster", speculating.cluster], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    text = status.stdout
    assert '"draft"' in text and "acceptance" in text, text
    json.loads(text)

    assert wait_for(lambda: all(u.used == 0 and u.idle for u in kv_usage(speculating).values()), timeout_s=20)


def test_cancellation_soak_frees_draft_kv_too(speculating: Cluster) -> None:
    """Issue 11: draft KV stayed held ~60 s after requests finished. 40 requests, half cancelled
    before / during prefill / during decode, on a speculating cluster: afterwards no draft
    sequence is left (the lease is 600 s) and every pool, draft included, passes check_integrity()."""
    result = run_soak(speculating, 40, concurrency=8, seed=3)
    assert not result.failures, result.failures
    assert not any(draft_sequences(speculating).values())
    assert result.integrity and all(v == "" for v in result.integrity.values()), result.integrity


def test_draft_cluster_keeps_structured_outputs(speculating: Cluster) -> None:
    """Issue 12: the draft model knows nothing of the grammar; decode's verification does. Seeded
    sampled json_schema requests through the draft-speculating cluster all validate."""
    import jsonschema

    from tests.structured.test_structured_engine import PERSON

    client = openai_client(speculating)
    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    drafted0, _ = _spec_counts(speculating)
    replies = parallel(lambda seed: client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A person as JSON"}], response_format=fmt,
        temperature=1.0, seed=seed, max_tokens=150), range(8))  # fmt: skip
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    assert _spec_counts(speculating)[0] > drafted0
    assert wait_for(lambda: all(u.used == 0 and u.idle for u in kv_usage(speculating).values()), timeout_s=20)
