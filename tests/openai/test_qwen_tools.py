"""Acceptance 2 with Qwen2.5-Coder-0.5B-Instruct behind a real cluster: `tool_choice: auto`.

Its chat template has a tools section (Hermes-style <tool_call> instructions), but the 0.5B model
answers in a fenced ```json block with {"name", "arguments"}; auto's parser for Qwen templates
(tool_parsers.QwenParser) reads that as a call because the name is a declared tool.

Marked `qwen`: skipped unless TANDEM_QWEN_TESTS=1 (a 478 MB download); the last run is recorded in
docs/openai.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import openai_client
from tests.openai.conftest import one_decode_cluster
from tests.openai.test_tool_parsers import WEATHER
from tests.real_models.real_model_helpers import QWEN_05B, real_model

pytestmark = pytest.mark.qwen
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def qwen(redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    yield from one_decode_cluster(real_model(QWEN_05B), redis_url, dev_certs, tmp_path_factory, "qwen-tools",
                                  mode="aggregated")


@pytest.fixture(scope="module")
def client(qwen) -> openai.OpenAI:
    return openai_client(qwen, timeout=900)


def test_get_weather_auto_round_trip(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content  # the fenced block was the call, not content

    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=60,
                                                 temperature=0, stream=True))  # fmt: skip
    deltas = [d for ch in chunks for c in ch.choices for d in c.delta.tool_calls or []]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [("get_weather", {"city": "Paris"})]
    assert "```" not in "".join(c.delta.content or "" for ch in chunks for c in ch.choices)

    # Right after the tool result the 0.5B model repeats its call (as bare JSON lines); asked once
    # more, it answers from the result.
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"},
                     {"role": "user", "content": "So what is the weather in Paris? Answer in one sentence."}]
    reply = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], max_tokens=40,
                                           temperature=0)  # fmt: skip
    answer = reply.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content and "22" in answer.message.content, answer.message.content


def test_plain_code_with_json_is_not_a_call(client):
    """A code answer whose JSON names no declared tool stays content."""
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, tools=[WEATHER], max_tokens=60, temperature=0, messages=[
        {"role": "user", "content": "Write a JSON object with keys name and age for a person called Ann, 30."}])
    choice = reply.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert "Ann" in (choice.message.content or "")
