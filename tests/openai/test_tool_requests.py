"""Tool-calling requests through a real cluster (tiny model): accepted shapes, history, clear 400s.
The tiny model's output is random, so the parse path itself is tested with SmolLM2
(test_smollm2_tools.py) and as pure logic (test_tool_parsers.py)."""

from __future__ import annotations

import httpx
import pytest

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


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])  # fmt: skip
def test_tool_400s(base_url, model_id, extra, param):
    body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "max_tokens": 2,
            **extra}
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
