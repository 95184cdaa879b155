"""Acceptance 7: bad REST input gets the documented 4xx in OpenAI's error shape, naming the field,
and the gateway is unharmed (a good request right after succeeds).

    400 a bad field (param names it)    413 prompt does not fit the context
    422 body is not UTF-8 JSON          (services/gateway/errors.py)
"""

from __future__ import annotations

import httpx
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import complete_ids, get, post, served_model

LONG_PROMPT = [100] * 5000  # the tiny model's context is 4,096 tokens


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _good(model: str, **overrides):
    return {"model": model, "prompt": "Hello", "max_tokens": 4, **overrides}


CASES = [
    # (id, body overrides, expected status, param)
    ("empty-prompt", {"prompt": ""}, 400, "prompt"),
    ("empty-token-prompt", {"prompt": []}, 400, "prompt"),
    ("max-tokens-zero", {"max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", {"max_tokens": -5}, 400, "max_tokens"),
    ("prompt-too-long", {"prompt": LONG_PROMPT}, 413, "prompt"),
    ("temperature-negative", {"temperature": -1.0}, 400, "temperature"),
    ("top-p-zero", {"top_p": 0.0}, 400, "top_p"),
    ("top-p-above-one", {"top_p": 1.5}, 400, "top_p"),
    ("min-p-above-one", {"min_p": 2.0}, 400, "min_p"),
    ("presence-penalty", {"presence_penalty": 3.0}, 400, "presence_penalty"),
    ("n-zero", {"n": 0}, 400, "n"),
    ("logprobs-too-many", {"logprobs": 50}, 400, "logprobs"),
    ("temperature-string", {"temperature": "hot"}, 400, "temperature"),
    # Issue 11, defect 6: each of these was accepted (or a 500) before.
    ("temperature-huge", {"temperature": 1e9}, 400, "temperature"),
    ("seed-over-int64", {"seed": 2**63}, 400, "seed"),
    ("stop-token-outside-vocabulary", {"stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("n-huge", {"n": 10_000}, 400, "n"),
    ("deep-json", {"user": _nested(200)}, 400, "user"),  # the gateway allows 128 levels
]


@pytest.fixture(scope="module")
def model(disagg: Cluster) -> str:
    return served_model(disagg)


def _assert_error(reply: httpx.Response, status: int, param: str | None) -> dict:
    assert reply.status_code == status, f"{reply.status_code} {reply.text}"
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
        assert param in error["message"] or error["param"] == param
    return error


@pytest.mark.parametrize(("overrides", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_completion_field(disagg: Cluster, model: str, overrides, status, param) -> None:
    reply = post(disagg, "/v1/completions", json=_good(model, **overrides), timeout=30)
    _assert_error(reply, status, param)


def test_bad_chat_fields(disagg: Cluster, model: str) -> None:
    path = "/v1/chat/completions"
    reply = post(disagg, path, json={"model": model, "messages": [], "max_tokens": 4}, timeout=30)
    _assert_error(reply, 400, "messages")
    reply = post(disagg, path, json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 0}, timeout=30)  # fmt: skip
    _assert_error(reply, 400, "max_tokens")
    reply = post(disagg, path, json={"model": model, "messages": [{"role": "wizard", "content": "hi"}]}, timeout=30)
    _assert_error(reply, 400, "messages")


def test_lone_surrogate_and_huge_body(disagg: Cluster, model: str) -> None:
    path = "/v1/completions"
    reply = post(disagg, path, content=b'{"prompt": "hi \\ud800", "max_tokens": 2}',
                 headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    _assert_error(reply, 400, "prompt")
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'  # over the default --max-request-body-bytes (8 MiB)
    reply = post(disagg, path, content=big, headers={"content-type": "application/json"}, timeout=60)
    _assert_error(reply, 413, "body")


def test_unknown_model_is_404(disagg: Cluster) -> None:
    reply = post(disagg, "/v1/completions", json=_good("no-such-model"), timeout=30)
    _assert_error(reply, 404, "model")


@pytest.mark.parametrize(
    "body", [b'{"prompt": "x", "max_tokens": ', b"\xff\xfe\x00not utf-8", b"[1, 2, 3]"],
    ids=["malformed-json", "non-utf8", "not-an-object"],
)
def test_unreadable_body_is_422(disagg: Cluster, model: str, body: bytes) -> None:
    reply = post(disagg, "/v1/completions", content=body,
                 headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    error = _assert_error(reply, 422 if body != b"[1, 2, 3]" else reply.status_code, None)
    assert reply.status_code in (400, 422)
    assert error["message"]


def test_server_unharmed(disagg: Cluster) -> None:
    assert get(disagg, "/health", timeout=10).status_code == 200
    assert len(complete_ids(disagg, [10, 11, 12, 13], max_tokens=3)) == 3
    assert all(p.is_running for p in disagg.processes)
