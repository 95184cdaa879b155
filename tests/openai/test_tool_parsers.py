"""Tool-call parsers and the tools part of chat requests: pure logic, no network."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import InvalidRequest
from services.gateway.tool_calls import calls_schema, fallback_messages, parse_tools
from services.gateway.tool_parsers import HermesParser, JsonBlockParser, Llama3JsonParser, QwenParser, parser_for

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}  # fmt: skip


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_whole_answer():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    content, calls = HermesParser().parse(text)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert HermesParser().parse("no calls here") == ("no calls here", [])
    broken = "<tool_call>{not json}</tool_call> ok"
    assert HermesParser().parse(broken) == (broken, [])  # kept as content, nothing dropped
    content, calls = HermesParser().parse('<tool_call>{"name": "f", "arguments": {}}')  # cut before the tag
    assert content == "" and _calls(calls) == [("f", {})]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_hermes_incremental_equals_whole(step):
    text = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and <tool_' \
           'call>{"name": "g", "arguments": {}}</tool_call> done <tool'
    stream = HermesParser().stream()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = stream.feed(text[i:i + step])
        assert "<tool_call" not in c
        content, calls = content + c, calls + k
    c, k = stream.finish()
    content, calls = content + c, calls + k
    whole_content, whole_calls = HermesParser().parse(text)
    assert content.strip() == whole_content and _calls(calls) == _calls(whole_calls)
    assert content.endswith("<tool")  # a partial tag is content once the answer ends


def test_llama3_json():
    p = Llama3JsonParser()
    assert _calls(p.parse('{"name": "get_weather", "parameters": {"city": "Oslo"}}')[1]) == [
        ("get_weather", {"city": "Oslo"})]
    content, calls = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert content == "" and _calls(calls) == [("a", {}), ("b", {"x": 1})]
    assert p.parse("Hello {there}") == ("Hello {there}", [])
    s = p.stream()
    assert s.feed("Hel") == ("Hel", []) and s.feed("lo") == ("lo", [])
    s = p.stream()
    assert s.feed('{"name": "a", ') == ("", []) and s.feed('"parameters": {}}') == ("", [])
    assert _calls(s.finish()[1]) == [("a", {})]


QWEN_CODER_ANSWER = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'  # what 0.5B writes


def test_json_block_reads_fenced_calls_of_declared_tools():
    p = JsonBlockParser(["get_weather", "get_time"])
    content, calls = p.parse(QWEN_CODER_ANSWER)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris"})]
    text = 'Calling both:\n```json\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}, ' \
           '{"name": "get_time", "parameters": {}}]\n```\nDone.'
    content, calls = p.parse(text)
    assert content == "Calling both:\n\nDone." and _calls(calls) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert _calls(p.parse('```\n{"name": "get_time", "arguments": "{}"}\n```')[1]) == [("get_time", {})]  # no language


@pytest.mark.parametrize("text", [
    # Code answers that merely contain JSON: not calls, kept whole.
    '```json\n{"name": "Alice", "age": 3}\n```',
    'Here is a config:\n```json\n{"name": "delete_files", "arguments": {"path": "/"}}\n```',  # not a declared tool
    '```json\n[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "rm", "arguments": {}}]\n```',
    '```python\nprint({"name": "get_weather", "arguments": {}})\n```',
    '```json\n{"name": "get_weather", "arguments": [1, 2]}\n```',
    '```json\n{not json}\n```',
    "plain text with ``` one fence",
])  # fmt: skip
def test_json_block_leaves_other_code_alone(text):
    assert JsonBlockParser(["get_weather"]).parse(text) == (text.strip(), [])
    assert JsonBlockParser().parse(QWEN_CODER_ANSWER) == (QWEN_CODER_ANSWER, [])  # no tools declared: no calls


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_qwen_parser_streams_both_formats(step):
    text = 'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n``` and ' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> then ```json\n{"a": 1}\n``` end ``'
    parser = QwenParser(["get_weather", "get_time"])
    stream = parser.stream()
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = stream.feed(text[i:i + step])
        assert '"get_weather"' not in c and "<tool_call" not in c
        content, calls = content + c, calls + k
    c, k = stream.finish()
    content, calls = content + c, calls + k
    whole_content, whole_calls = parser.parse(text)  # calls of the two formats may come in another order
    assert content.strip() == whole_content and sorted(_calls(calls)) == sorted(_calls(whole_calls))
    assert sorted(_calls(calls)) == [("get_time", {}), ("get_weather", {"city": "Paris"})]
    assert '```json\n{"a": 1}\n```' in content and content.endswith("end ``")  # plain code stays content


def test_qwen_parser_reads_a_bare_json_answer_of_declared_tools():
    parser = QwenParser(["get_weather"])
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # Qwen2.5-Coder-0.5B, asked differently
    assert _calls(parser.parse(bare)[1]) == [("get_weather", {"city": "Paris"})]
    stream = parser.stream()
    assert stream.feed(bare[:10]) == ("", [])
    content, calls = stream.feed(bare[10:])
    rest, more = stream.finish()
    assert content + rest == "" and _calls(calls + more) == [("get_weather", {"city": "Paris"})]
    for text in ('{"name": "other", "arguments": {}}', '{"name": "get_weather"} and more', "[1, 2]"):
        assert parser.parse(text) == (text, [])


def test_parser_choice():
    qwen_template = "<|im_start|>system{% if tools %}<tools>...<tool_call>{% endif %}<|im_end|>"
    assert parser_for("auto", qwen_template, ["f"]).name == "qwen"
    assert parser_for("json_block", None).name == "json_block"
    assert parser_for("auto", "{% if tools %}<tool_call>{% endif %}").name == "hermes"
    assert parser_for("auto", "<|python_tag|> ipython").name == "llama3_json"
    assert parser_for("llama3_json", None).name == "llama3_json"
    with pytest.raises(ValueError):
        parser_for("nope", None)


def test_parse_tools_validation():
    ok = parse_tools({"tools": [WEATHER]}, "auto", None)
    assert ok.choice == "auto" and ok.parallel
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}, "auto", None).parses is False
    assert parse_tools({}, "auto", None) is None
    bad = [
        ({"tool_choice": "auto"}, "tool_choice"), ({"tools": "x"}, "tools"), ({"tools": [{"type": "code"}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"), ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]  # fmt: skip
    for body, param in bad:
        with pytest.raises(InvalidRequest) as info:
            parse_tools(body, "auto", None)
        assert info.value.param == param, body


def test_required_and_named_build_the_calls_schema():
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required"}, "auto", None)
    assert required.constrained and calls_schema(required)["minItems"] == 1 and "maxItems" not in calls_schema(required)
    named = parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                         "parallel_tool_calls": False}, "auto", None)
    schema = calls_schema(named)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    msg, finish = named.message('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "stop")
    assert finish == "tool_calls" and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_message_shapes_and_parallel_off():
    req = parse_tools({"tools": [WEATHER], "parallel_tool_calls": False}, "hermes", None)
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' \
           '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    msg, finish = req.message(text, "stop")
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1 and msg["content"] is None
    assert msg["tool_calls"][0]["type"] == "function"
    plain, finish = req.message("Just text", "stop")
    assert plain == {"role": "assistant", "content": "Just text"} and finish == "stop"
    _, finish = req.message(text, "length")
    assert finish == "length"  # cut by max_tokens: the reason stays


def test_fallback_messages_for_a_template_without_tools():
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]  # fmt: skip
    out = fallback_messages(history, [WEATHER])
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2]["content"] == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
