"""Chat tool calling: `tools`, `tool_choice`, `parallel_tool_calls` -> prompt, and output -> tool_calls.

    request   tools (OpenAI function tools) are rendered by the model's own chat template
              (apply_chat_template(tools=...)). A template without a tools section (SmolLM2's)
              would drop them silently, so the gateway then writes them into the system message
              itself, in the Hermes format the hermes parser reads (docs/design.md says so too).
    history   assistant messages with tool_calls and role "tool" results are accepted; for a
              template without tools support they become <tool_call> / <tool_response> text.
    output    tool_choice "auto": the answer goes through the model's parser (tool_parsers.py);
              calls found -> message.tool_calls and finish_reason "tool_calls". "none": not parsed.
              "required" / a named function: the output is constrained by a JSON-schema grammar
              (structured outputs, calls_schema) to an array of calls, so it always parses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from common.sampling.params import SamplingParams
from common.structured.spec import GrammarSpec
from services.gateway.errors import InvalidRequest
from services.gateway.tool_parsers import StreamParser, ToolCall, ToolParser, call_from_json, parser_for

_FALLBACK_PREAMBLE = (
    "You may call functions to help with the user's request. The functions are listed as JSON "
    "schemas inside <tools></tools>.\n<tools>\n{tools}\n</tools>\nTo call a function, answer with "
    "<tool_call>{{\"name\": <function name>, \"arguments\": <JSON object of arguments>}}</tool_call> "
    "for each call, and nothing else."
)


@dataclass
class ToolsRequest:
    tools: list[dict[str, Any]]  # validated OpenAI tools: {"type": "function", "function": {...}}
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool
    parser: ToolParser
    constrained: bool = False  # required / named: the output is JSON from a grammar, not parsed text
    _streams: dict[int, _ChoiceToolStream] = field(default_factory=dict)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    # ---- prompt

    def render(self, model, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the tools, through the model's template if it can."""
        if template_supports_tools(model):
            return model.tokenize_chat(messages, tools=self.tools)
        return model.tokenize_chat(fallback_messages(messages, self.tools))

    # ---- output

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if not self.parses:
            return text, []
        if self.constrained:
            return _constrained_calls(text)
        content, calls = self.parser.parse(text)
        return content or None, calls

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = self.split(text)
        calls = calls if self.parallel else calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
        if calls:
            message["tool_calls"] = [call_dict(c) for c in calls]
            if finish == "stop":
                finish = "tool_calls"
        return message, finish

    def delta(self, index: int, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """Streaming: one choice's new text -> (content text, OpenAI tool-call deltas, finish reason)."""
        if not self.parses:
            return text, [], finish
        stream = self.stream(index)
        text, calls = stream.feed(text, finished=finish is not None)
        if finish == "stop" and stream.num_calls:
            finish = "tool_calls"
        return text, calls, finish

    def stream(self, index: int) -> _ChoiceToolStream:
        if index not in self._streams:
            inner = _ConstrainedStream() if self.constrained else self.parser.stream()
            self._streams[index] = _ChoiceToolStream(inner, self.parallel)
        return self._streams[index]


@dataclass
class _ChoiceToolStream:
    """One choice's streaming state: content deltas out, whole tool calls as OpenAI deltas."""

    parser: StreamParser
    parallel: bool
    num_calls: int = 0

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.parser.feed(text)
        if finished:
            rest, more = self.parser.finish()
            content, calls = content + rest, calls + more
        deltas = []
        for c in calls:
            if not self.parallel and self.num_calls >= 1:
                break
            deltas.append({"index": self.num_calls, **call_dict(c)})
            self.num_calls += 1
        return content, deltas


def call_dict(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def _constrained_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """required / named output: a JSON array of {"name", "parameters"} objects (the grammar's)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return text, []
    calls = [call_from_json(i) for i in (items if isinstance(items, list) else [items])]
    return (None, [c for c in calls if c is not None]) if all(calls) else (text, [])


@dataclass
class _ConstrainedStream:
    buffer: str = ""

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = _constrained_calls(self.buffer)
        return content or "", calls


# --------------------------------------------------------------------------- parsing the request


def constrain_tool_calls(params: SamplingParams, tools: ToolsRequest | None) -> SamplingParams:
    """required / named: the output must be an array of allowed calls (a JSON-schema grammar)."""
    if tools is None or not tools.constrained:
        return params
    if params.grammar is not None:
        raise InvalidRequest(f"tool_choice {tools.choice!r} constrains the output itself; it cannot be combined "
                             f"with {params.grammar.source}", param="tool_choice")
    return replace(params, grammar=GrammarSpec.json_schema(calls_schema(tools), source="tool_choice"))


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function "
                             "tools are supported)", param="tools")
    f = t["function"]
    if not isinstance(f.get("name"), str) or not f["name"]:
        raise InvalidRequest(f"{where}.function.name must be a non-empty string", param="tools")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequest(f"{where}.function.parameters must be a JSON schema object", param="tools")
    if "description" in f and not isinstance(f["description"], str):
        raise InvalidRequest(f"{where}.function.description must be a string", param="tools")
    return {"type": "function", "function": {**f, "parameters": params}}


def parse_tools(body: Mapping[str, Any], parser_name: str, chat_template: str | None) -> ToolsRequest | None:
    """The tools part of a chat body; None when the request has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list", param="tools")
    tools = [_tool(t, i) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique", param="tools")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in names:
            raise InvalidRequest(f"tool_choice names a function that is not in tools: {named!r}", param="tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice must be none, auto, required or {{\"type\": \"function\", ...}}, got "
                             f"{choice!r}", param="tool_choice")
    constrained = choice in ("required", "named")
    try:
        parser = parser_for(parser_name, chat_template, names)
    except ValueError as e:
        raise InvalidRequest(str(e), param="tools") from None
    return ToolsRequest(tools, choice, named, parallel, parser, constrained)


def calls_schema(req: ToolsRequest) -> dict[str, Any]:
    """The JSON schema that `required` / named output must follow: an array of calls."""
    chosen = [t for t in req.tools if req.named is None or t["function"]["name"] == req.named]
    one = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]}, "parameters": t["function"]["parameters"]},
        "required": ["name", "parameters"], "additionalProperties": False} for t in chosen]}
    return {"type": "array", "items": one, "minItems": 1, **({} if req.parallel else {"maxItems": 1})}


# --------------------------------------------------------------------------- history


def history_message(m: Mapping[str, Any], i: int) -> dict[str, Any]:
    """The tool parts of a message (assistant tool_calls, a tool result's id), checked, with the
    arguments as objects: chat templates render them with `tojson`."""
    out: dict[str, Any] = {}
    calls = m.get("tool_calls")
    if calls is not None:
        if m.get("role") != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list on an assistant message", param="messages")
        out["tool_calls"] = [_history_call(c, i) for c in calls]
    if m.get("role") == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise InvalidRequest(f"messages[{i}].tool_call_id is required on a tool message", param="messages")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _history_call(c: Any, i: int) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequest(f"messages[{i}].tool_calls: each needs function.name", param="messages")
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise InvalidRequest(f"messages[{i}].tool_calls: function.arguments is not JSON", param="messages") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def template_supports_tools(model) -> bool:
    template = getattr(model.tokenizer, "chat_template", None) or ""
    return "tools" in template


def fallback_messages(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that cannot render tools: the tools in the system message, past calls and
    results as Hermes text (<tool_call> / <tool_response>)."""
    preamble = _FALLBACK_PREAMBLE.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False)
                                                         for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            text = "".join(f"<tool_call>{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                           f"</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m.get("content") or "") + text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content", "name")})
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
    else:
        out.insert(0, {"role": "system", "content": preamble})
    return out
