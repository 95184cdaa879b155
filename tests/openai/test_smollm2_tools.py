"""Acceptance 2 and 4 with a real instruct model: SmolLM2-135M-Instruct behind a real cluster.

SmolLM2's chat template has no tools section, so the gateway writes the tools into the system
message in the Hermes format (tool_calls.py). Asked cold, the 135M model answers in prose; with
two earlier calls in the conversation it calls the tool itself, in the Hermes format, which is
what these tests use to drive the whole path: parsed tool_calls with finish_reason "tool_calls",
the same call reassembled from streamed deltas, and the tool's result sent back yielding a normal
answer. LangChain's ChatOpenAI (invoke, stream, bind_tools, with_structured_output) runs against
the same cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import langchain_connection, openai_client
from tests.openai.conftest import one_decode_cluster
from tests.openai.test_tool_parsers import WEATHER


def _call(city: str, i: int) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


# Two worked examples, then the question: the model continues the pattern with a call for Rome.
FEW_SHOT = [{"role": "user", "content": "What's the weather in Paris?"}, _call("Paris", 1),
            {"role": "user", "content": "What's the weather in Berlin?"}, _call("Berlin", 2),
            {"role": "user", "content": "What's the weather in Rome?"}]  # fmt: skip


@pytest.fixture(scope="module")
def smol(smollm2_model, redis_url: str, dev_certs, tmp_path_factory) -> Iterator[Cluster]:
    yield from one_decode_cluster(smollm2_model, redis_url, dev_certs, tmp_path_factory, "smollm2-tools")


@pytest.fixture(scope="module")
def smol_client(smol) -> openai.OpenAI:
    return openai_client(smol, timeout=600)


@pytest.fixture(scope="module")
def smol_id(smol_client) -> str:
    return smol_client.models.list().data[0].id


def test_auto_yields_a_parsed_call(smol_client, smol_id):
    reply = smol_client.chat.completions.create(model=smol_id, messages=FEW_SHOT, tools=[WEATHER], max_tokens=40,
                                                temperature=0)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
    assert not choice.message.content


def test_streamed_deltas_reassemble_to_the_same_call(smol_client, smol_id):
    chunks = list(smol_client.chat.completions.create(model=smol_id, messages=FEW_SHOT, tools=[WEATHER],
                                                      max_tokens=40, temperature=0, stream=True))  # fmt: skip
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Rome"}
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_the_tool_result_sent_back_yields_a_normal_answer(smol_client, smol_id):
    first = smol_client.chat.completions.create(model=smol_id, messages=FEW_SHOT, tools=[WEATHER], max_tokens=40,
                                                temperature=0)  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    history = FEW_SHOT + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    reply = smol_client.chat.completions.create(model=smol_id, messages=history, tools=[WEATHER], max_tokens=30,
                                                temperature=0)  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content


def test_cold_prompt_is_answered_in_prose(smol_client, smol_id):
    """What happens without examples: the tools are in the prompt (the gateway's fallback for a
    template with no tools section), and SmolLM2-135M answers without calling them."""
    reply = smol_client.chat.completions.create(model=smol_id, tools=[WEATHER], max_tokens=30, temperature=0,
                                                messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    choice = reply.choices[0]
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    assert choice.message.content or choice.message.tool_calls


def test_langchain_chat_openai(smol, smol_id):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(**langchain_connection(smol), model=smol_id, temperature=0, max_tokens=12)
    answer = llm.invoke("What is the capital of France?")
    assert isinstance(answer, AIMessage) and answer.content
    streamed = "".join(chunk.content for chunk in llm.stream("What is the capital of France?"))
    assert streamed == answer.content

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city"""
        return "22 C"

    history = [HumanMessage(m["content"]) if m["role"] == "user" else AIMessage("", tool_calls=[
        {"name": "get_weather", "args": json.loads(m["tool_calls"][0]["function"]["arguments"]),
         "id": m["tool_calls"][0]["id"]}]) for m in FEW_SHOT]
    bound = ChatOpenAI(**langchain_connection(smol), model=smol_id, temperature=0,
                       max_tokens=40).bind_tools([get_weather])
    called = bound.invoke(history)
    assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather"
    assert called.tool_calls[0]["args"] == {"city": "Rome"}

    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    structured = ChatOpenAI(**langchain_connection(smol), model=smol_id, temperature=0,
                            max_tokens=60).with_structured_output(Capital)
    got = structured.invoke("What is the capital of France? Answer in JSON.")
    assert isinstance(got, Capital) and got.capital
