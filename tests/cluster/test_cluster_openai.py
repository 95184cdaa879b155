"""Acceptance 2: the official `openai` client against the gateway of a disaggregated cluster:
completions, chat, streaming (with usage), stop strings, usage, n, logprobs."""

from __future__ import annotations

import openai
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import openai_client


@pytest.fixture(scope="module")
def client(disagg: Cluster) -> openai.OpenAI:
    return openai_client(disagg)


@pytest.fixture(scope="module")
def model_id(client: openai.OpenAI) -> str:
    models = client.models.list().data
    assert len(models) == 1
    return models[0].id


def test_completion_usage(client, model_id) -> None:
    reply = client.completions.create(model=model_id, prompt="The quick brown fox", max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert isinstance(choice.text, str)
    assert reply.usage.completion_tokens == 6
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 6


def test_chat_completion(client, model_id) -> None:
    reply = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say something."}], max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert reply.usage.completion_tokens == 5


def test_streaming_equals_non_streaming(client, model_id) -> None:
    kwargs = dict(model=model_id, prompt="Once upon a time", max_tokens=8, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]


def test_chat_streaming(client, model_id) -> None:
    kwargs = dict(model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    # A reader that falls behind gets what piled up as one chunk (outputs.coalesce), so the
    # number of chunks is the machine's; what they carry, in order, is not.
    assert chunks and "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string(client, model_id) -> None:
    kwargs = dict(model=model_id, prompt="Hello", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) >= 4, f"need some text to cut: {full!r}"
    stop = full[2:4]  # a stop string that occurs in the greedy output
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kwargs)
                       if c.choices)  # fmt: skip
    assert streamed == cut.text


def test_n_choices(client, model_id) -> None:
    reply = client.completions.create(model=model_id, prompt="Pick a number", max_tokens=5, n=3,
                                      temperature=1.0, seed=7, extra_body={"ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert reply.usage.completion_tokens == 15


def test_logprobs(client, model_id) -> None:
    reply = client.completions.create(model=model_id, prompt="Logprobs please", max_tokens=4, temperature=0,
                                      logprobs=3, extra_body={"ignore_eos": True})  # fmt: skip
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the sampled token is the top one
    chat = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
