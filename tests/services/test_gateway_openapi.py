"""Schemathesis over the served OpenAPI document (GET /openapi.json), against a real gateway and a
real decode worker: whatever the fuzzer sends, valid or not, the answer is never a 5xx.

Bounded so it fits `make test`: a fixed seed (derandomized), a few examples per operation and
mode, and a time budget after which remaining examples are generated but not sent (the budget
is a bound on the work, never an assertion). The gateway serves a 64-token context and --max-n 2
so valid requests generate little.
"""

from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from services.gateway.model import ServedModel
from tests.services.gateway_helpers import MiniCluster, served_model

MAX_EXAMPLES = 30
BUDGET_S = 60.0  # per operation and mode
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
RUNS = [  # GETs without parameters have no negative form
    ("/v1/completions", "POST", POSITIVE), ("/v1/completions", "POST", NEGATIVE),
    ("/v1/chat/completions", "POST", POSITIVE), ("/v1/chat/completions", "POST", NEGATIVE),
    ("/v1/models", "GET", POSITIVE), ("/health", "GET", POSITIVE),
]


@pytest.fixture(scope="module")
def mini(tiny_model, redis_url):
    base = served_model(tiny_model)
    small = ServedModel(base.name, base.tokenizer, max_model_len=64, vocab_size=base.vocab_size)
    cluster = MiniCluster(tiny_model, redis_url, prefill=False, num_kv_blocks=64, served=small, max_n=2)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def schema(mini):
    url = mini.url("aggregated")
    doc = httpx.get(url + "/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(doc), url


@pytest.mark.parametrize(("path", "method", "mode"), RUNS, ids=[f"{m} {p} {g}" for p, m, g in RUNS])
def test_no_server_errors(schema, mini, path, method, mode):
    loaded, url = schema
    operation = loaded[path][method]
    started, sent = time.monotonic(), []

    @settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case) -> None:
        if time.monotonic() - started > BUDGET_S:
            return  # out of budget: generated, not sent
        response = case.call_and_validate(base_url=url, checks=[not_a_server_error], timeout=120)
        sent.append(response.status_code)

    fuzz()
    print(f"{method} {path} {mode}: statuses {sorted(set(sent))} of {len(sent)} sent")
    assert sent, "no example was sent"
    assert mini.decode_at_baseline(timeout=30), "the decode worker kept KV blocks after the fuzzing"
