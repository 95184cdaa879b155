"""Tool-calling requests through a real cluster (tiny model): accepted shapes, history, clear 400s.
The tiny model's output is random, so the parse path itself is tested with SmolLM2
(test_smollm2_tools.py) and as pure logic (test_tool_parsers.py)."""

from __future__ import annotations

import json

import pytest

from tests.cluster.cluster_helpers import gateway_channel
from tests.openai.test_tool_parsers import WEATHER

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]  # fmt: skip


def test_tools_auto_and_none_and_history(client, model_id):
    for choice in ("auto", "none"):
        reply = client.chat.completions.create(model=model_id, messages=HISTORY, tools=[WEATHER], tool_choice=choice,
                                               max_tokens=4, temperature=0)  # fmt: skip
        c = reply.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert (c.finish_reason == "tool_calls") == bool(c.message.tool_calls)
    chunks = list(client.chat.completions.create(model=model_id, messages=HISTORY, tools=[WEATHER], max_tokens=4,
                                                 temperature=0, stream=True))  # fmt: skip
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_always_yield_a_valid_call(client, model_id, choice):
    """The grammar (structured outputs) makes even the random tiny model's output a valid call."""
    import jsonschema

    # Bounded arguments (enums): the random model could make a free string longer than max_tokens.
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}  # fmt: skip
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (weather, other)}
    for seed in range(4):
        reply = client.chat.completions.create(model=model_id, messages=HISTORY[:1], tools=[weather, other],
                                               tool_choice=choice, max_tokens=120, temperature=1.0, seed=seed,
                                               parallel_tool_calls=False)  # fmt: skip
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # Streamed, with a tool whose arguments are bounded (an enum), so max_tokens cannot cut the call.
    named = {"type": "function", "function": {"name": "get_time"}} if isinstance(choice, dict) else choice
    chunks = list(client.chat.completions.create(model=model_id, messages=HISTORY[:1], tools=[other],
                                                 tool_choice=named, max_tokens=120, temperature=1.0, seed=7,
                                                 stream=True))  # fmt: skip
    calls: dict[int, list[str]] = {}
    for d in (d for ch in chunks for c in ch.choices for d in (c.delta.tool_calls or [])):
        entry = calls.setdefault(d.index, ["", ""])
        entry[0] += d.function.name or ""
        entry[1] += d.function.arguments or ""
    assert calls and sorted(calls) == list(range(len(calls)))  # parallel calls allowed here: indexed 0, 1, ...
    for name, args in calls.values():
        assert name == "get_time"
        jsonschema.validate(json.loads(args), schemas["get_time"])
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])  # fmt: skip
def test_tool_400s(http, model_id, extra, param):
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 2,
            **extra}
    r = http.post("/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tools_over_grpc(disagg):
    """The same tools fields on tandem.v1.Generation: required -> parsed ToolCalls, TOOL_CALLS."""
    import grpc

    from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    zone = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}  # fmt: skip
    chat = generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content="Time?"),
                  generation_pb2.ChatMessage(role="assistant", tool_calls=[
                      generation_pb2.ToolCall(id="call_1", name="get_time", arguments='{"zone": "UTC"}')]),
                  generation_pb2.ChatMessage(role="tool", content="12:00", tool_call_id="call_1"),
                  generation_pb2.ChatMessage(role="user", content="And in CET?")],
        tools_json=json.dumps([zone]), tool_choice_json='"required"', parallel_tool_calls=False)
    request = generation_pb2.GenerateRequest(chat=chat, sampling=common_pb2.SamplingParams(max_tokens=60, seed=3))
    with gateway_channel(disagg) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = stub.Complete(request, timeout=120)
        (choice,) = reply.choices
        assert choice.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
        (call,) = choice.tool_calls
        assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET") and call.id
        streamed = [c for m in stub.Generate(request, timeout=120) for d in m.choices for c in d.tool_calls]
        assert [(c.name, json.loads(c.arguments)) for c in streamed] == [(call.name, json.loads(call.arguments))]
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(generation_pb2.GenerateRequest(chat=generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="x")], tools_json="[oops")), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.tools_json" in info.value.details()
