"""Acceptance 1 and 5 of issue 12: structured outputs through real clusters, with the official
`openai` client. JSON-schema output validates for 20 seeded sampled requests on the shared
disaggregated cluster and on a disaggregated cluster with n-gram speculation; regex, choice and
EBNF constraints hold; a structural tag's tagged parts parse as their schemas; the same spec over
gRPC Generation; a grammar too slow to compile is a 400 with the reason, and the cluster keeps
serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import openai
import pytest

from services.launcher.cluster import Cluster
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster.cluster_helpers import (ENGINE_ARGS, PINNED_K, gateway_channel, kv_usage, openai_client, parallel,
                                           start_secure_cluster, wait_for, worker_metrics)  # fmt: skip
from tests.structured.test_structured_engine import PERSON, REPORT_TAG, assert_report, slow_schema

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _client(cluster: Cluster) -> openai.OpenAI:
    return openai_client(cluster)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _json_chat(client: openai.OpenAI, seed: int):
    return client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=RESPONSE_FORMAT, temperature=1.0, seed=seed, max_tokens=150,
    )  # fmt: skip


def _assert_20_seeded_json(client: openai.OpenAI) -> None:
    replies = parallel(lambda seed: _json_chat(client, seed), range(20), workers=8)
    texts = []
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.append(choice.message.content)
    assert len(set(texts)) > 1  # really sampled


def _idle(cluster: Cluster) -> bool:
    return wait_for(lambda: all(u.used == 0 and u.idle for u in kv_usage(cluster).values()), timeout_s=30)


@pytest.fixture(scope="module")
def client(disagg: Cluster) -> openai.OpenAI:
    return _client(disagg)


def test_json_schema_20_seeded_disaggregated(client, disagg) -> None:
    _assert_20_seeded_json(client)
    assert _idle(disagg)


def test_regex_choice_and_grammar_hold(client) -> None:
    model = _model(client)
    regex = r"[a-c]{2,5}-\d{3}"
    for seed in range(4):
        reply = client.completions.create(model=model, prompt="Code:", max_tokens=40, temperature=1.0, seed=seed,
                                          extra_body={"guided_regex": regex})  # fmt: skip
        assert re.fullmatch(regex, reply.choices[0].text) and reply.choices[0].finish_reason == "stop"
    options = ["red", "green", "dark blue"]
    for seed in range(4):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "A colour?"}], temperature=1.0, seed=seed,
            max_tokens=20, extra_body={"structured_outputs": {"choice": options}},
        )  # fmt: skip
        assert reply.choices[0].message.content in options and reply.choices[0].finish_reason == "stop"
    reply = client.completions.create(model=model, prompt="Digits:", max_tokens=30, temperature=1.0, seed=1,
                                      extra_body={"guided_grammar": 'root ::= "<" [0-9] [0-9]? ">"'})  # fmt: skip
    assert re.fullmatch(r"<\d\d?>", reply.choices[0].text)
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=60, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_structural_tag_output_conforms(client, disagg) -> None:
    """Both spellings: response_format (the tag object) and structured_outputs (its JSON text)."""
    model = _model(client)
    for seed in range(6):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Weather report"}], temperature=1.0, seed=seed,
            max_tokens=120, response_format=REPORT_TAG,
        )  # fmt: skip
        assert reply.choices[0].finish_reason == "stop"
        assert_report(reply.choices[0].message.content)
        reply = client.completions.create(model=model, prompt="Report:", max_tokens=120, temperature=1.0, seed=seed,
                                          extra_body={"structured_outputs": {"structural_tag": json.dumps(REPORT_TAG)}})
        assert_report(reply.choices[0].text)
    stub = generation_pb2_grpc.GenerationStub(gateway_channel(disagg))
    spec = common_pb2.GrammarSpec(kind=common_pb2.GRAMMAR_KIND_STRUCTURAL_TAG, value=json.dumps(REPORT_TAG),
                                  source="sampling.grammar")
    reply = stub.Complete(generation_pb2.GenerateRequest(text="Report:", sampling=common_pb2.SamplingParams(
        max_tokens=120, temperature=1.0, seed=9, grammar=spec)), timeout=120)  # fmt: skip
    assert_report(reply.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "structural_tag", "format": {"type": "bogus"}})
    assert e.value.body["param"] == "response_format" and "bogus" in e.value.body["message"]


def test_streamed_json_schema_reassembles(client) -> None:
    chunks = list(client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "A person"}], response_format=RESPONSE_FORMAT,
        temperature=1.0, seed=3, max_tokens=150, stream=True,
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_bad_constraints_are_400_by_name(client) -> None:
    model = _model(client)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=5, extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex" and "invalid regex" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format={"type": "yaml"})  # fmt: skip
    assert e.value.body["param"] == "response_format.type"


def test_grammar_over_grpc_generation(disagg) -> None:
    stub = generation_pb2_grpc.GenerationStub(gateway_channel(disagg))
    spec = common_pb2.GrammarSpec(kind=common_pb2.GRAMMAR_KIND_CHOICE, value='["alpha", "beta"]', source="sampling.grammar")
    reply = stub.Complete(generation_pb2.GenerateRequest(
        text="Pick:", sampling=common_pb2.SamplingParams(max_tokens=10, temperature=1.0, seed=2, grammar=spec)), timeout=120)
    assert reply.choices[0].text in ("alpha", "beta")
    bad = common_pb2.GrammarSpec(kind=common_pb2.GRAMMAR_KIND_REGEX, value="(", source="sampling.grammar")
    with pytest.raises(grpc.RpcError) as e:
        stub.Complete(generation_pb2.GenerateRequest(
            text="x", sampling=common_pb2.SamplingParams(max_tokens=5, grammar=bad)), timeout=120)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.grammar" in e.value.details()


def _own_cluster(tiny_model, redis_url: str, dev_certs, run_dir, mode: str, args: tuple[str, ...]) -> Iterator[Cluster]:
    with start_secure_cluster(
        tiny_model, dev_certs, mode=mode, num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url,
        extra_args=ENGINE_ARGS + args, run_dir=str(run_dir),
    ) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="module")
def speculating(tiny_model, redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    """Disaggregated, with n-gram speculation (k = 4 pinned) on decode."""
    args = PINNED_K + ("--speculative-method", "ngram", "--num-speculative-tokens", "4")
    yield from _own_cluster(tiny_model, redis_url, dev_certs, tmp_path_factory.mktemp("structured-spec"), "disaggregated", args)


def test_json_schema_20_seeded_with_speculation(speculating) -> None:
    _assert_20_seeded_json(_client(speculating))
    assert worker_metrics(speculating, "decode")[0].get("tandem_spec_decode_draft_tokens_total", 0) > 0
    assert _idle(speculating)


@pytest.fixture(scope="module")
def impatient(tiny_model, redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    """Aggregated, with a compile timeout far below any real compile of `slow_schema`."""
    args = ("--grammar-compile-timeout", "0.0001")
    yield from _own_cluster(tiny_model, redis_url, dev_certs, tmp_path_factory.mktemp("structured-timeout"), "aggregated", args)


def test_compile_timeout_is_400_with_the_reason(impatient) -> None:
    client = _client(impatient)
    model = _model(client)
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema(tag="c")}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                       response_format=fmt)  # fmt: skip
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "did not compile within" in e.value.body["message"]
    # Not a stalled server: an unconstrained request is served, and nothing is left held.
    reply = client.completions.create(model=model, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    assert _idle(impatient)
