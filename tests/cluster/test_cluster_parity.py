"""Acceptance 1: greedy output through the disaggregated cluster == transformers == aggregated mode,
token for token, for concurrent prompts of mixed lengths (1-5 prefill chunks of 32 tokens each).
Also acceptance 5's second half: the prompt tokens were computed on prefill, and its KV shipped."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import (
    BLOCK_SIZE,
    ENGINE_ARGS,
    MAX_TOKENS,
    PROMPT_LENGTHS,
    complete_ids,
    parallel,
    random_prompts,
    start_secure_cluster,
    worker_metrics,
)
from tests.engine.engine_helpers import hf_greedy

PROMPTS = random_prompts(PROMPT_LENGTHS, seed=1)


@pytest.fixture(scope="module")
def aggregated(tiny_model, redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, mode="aggregated", num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url,
        extra_args=ENGINE_ARGS, run_dir=str(tmp_path_factory.mktemp("aggregated")),
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[list[int]]:
    return hf_greedy(tiny_model, PROMPTS, MAX_TOKENS)


def _sum(samples: list[dict[str, float]], key: str) -> float:
    return sum(s.get(key, 0.0) for s in samples)


def test_disaggregated_greedy_matches_transformers(disagg: Cluster, reference) -> None:
    before_prefill = worker_metrics(disagg, "prefill")
    before_decode = worker_metrics(disagg, "decode")

    outputs = parallel(lambda p: complete_ids(disagg, p), PROMPTS)

    for prompt, got, want in zip(PROMPTS, outputs, reference):
        assert got == want, f"prompt of {len(prompt)} tokens: cluster {got} != transformers {want}"
    # The prompts were computed on prefill and their KV shipped to decode (acceptance 5).
    after_prefill, after_decode = worker_metrics(disagg, "prefill"), worker_metrics(disagg, "decode")
    computed = _sum(after_prefill, "tandem_prefill_tokens_total") - _sum(before_prefill, "tandem_prefill_tokens_total")
    sent_key, recv_key = 'tandem_kv_transfer_bytes_total{direction="send"}', 'tandem_kv_transfer_bytes_total{direction="recv"}'
    sent = _sum(after_prefill, sent_key) - _sum(before_prefill, sent_key)
    received = _sum(after_decode, recv_key) - _sum(before_decode, recv_key)
    decode_computed = _sum(after_decode, "tandem_prefill_tokens_total") - _sum(before_decode, "tandem_prefill_tokens_total")
    assert computed >= sum(PROMPT_LENGTHS), f"prefill computed {computed} prompt tokens"
    assert decode_computed == 0, f"decode computed {decode_computed} prompt tokens itself (fell back?)"
    # 4 layers x (K, V) x 16 tokens x 2 heads x 32 dims x 4 bytes per block, every full block at least.
    bytes_per_block = 4 * 2 * BLOCK_SIZE * 2 * 32 * 4
    assert sent >= sum(n // BLOCK_SIZE for n in PROMPT_LENGTHS) * bytes_per_block, f"prefill sent {sent} bytes"
    assert received == sent, f"decode received {received} bytes, prefill sent {sent}"


def test_aggregated_greedy_matches_disaggregated(aggregated: Cluster, disagg: Cluster, reference) -> None:
    outputs = parallel(lambda p: complete_ids(aggregated, p), PROMPTS)
    for prompt, got, want in zip(PROMPTS, outputs, reference):
        assert got == want, f"prompt of {len(prompt)} tokens: aggregated {got} != transformers {want}"
    again = parallel(lambda p: complete_ids(disagg, p), PROMPTS)
    assert again == outputs, "disaggregated and aggregated outputs differ"
    assert not aggregated.workers("prefill")
