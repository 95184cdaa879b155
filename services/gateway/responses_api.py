"""OpenAI's Responses API (`POST /v1/responses`), stateless: a chat completion in another shape.

    request:  input (a string, or a list of messages / input items) + instructions (a system
              message first) -> the chat template -> the same orchestrator path as chat.
              max_output_tokens, temperature, top_p, seed-free sampling as in chat. Nothing is
              stored: previous_response_id is refused (400) and the answer says `store: false`.
    response: {"object": "response", "output": [{"type": "message", "content": [{"type":
              "output_text", ...}]}], "usage": {"input_tokens", "output_tokens", ...}}; status
              "incomplete" with incomplete_details.reason "max_output_tokens" when cut by length.
    stream:   typed SSE events as the OpenAI SDK reads them: response.created, .in_progress,
              .output_item.added, .content_part.added, .output_text.delta*, .output_text.done,
              .content_part.done, .output_item.done, .completed (each with a sequence_number).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import InvalidRequest
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import ApiRequest, parse_chat
from services.gateway.request_types import ChoiceResult, ChoiceUpdate, Usage

# Fields of a Responses request this gateway serves (or checks); any other is refused by name.
_SERVED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
           "metadata", "user", "previous_response_id", "text", "tools", "tool_choice", "parallel_tool_calls",
           "truncation", "stream_options", "top_logprobs", "seed", "service_tier", "reasoning", "include"}
_ROLES = {"user", "system", "developer", "assistant"}


@dataclass
class ResponsesRequest:
    api: ApiRequest  # the chat request it became
    body: Mapping[str, Any]
    response_id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        if not items:
            raise InvalidRequest("input must not be empty", param="input")
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequest("input must be a string or a non-empty list of messages", param="input")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "function_call":  # a call the model made earlier: an assistant tool_calls entry
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            continue
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _string(item, "output", i)})
            continue
        if kind != "message":
            raise InvalidRequest(f"input[{i}]: items of type {kind!r} are not supported (messages, function_call, "
                                 "function_call_output)", param="input")
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"input[{i}].role must be one of {sorted(_ROLES)}, got {role!r}", param="input")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content(item.get("content"), i)})
    return messages


def _string(item: Mapping[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"input[{i}].{key} must be a string", param="input")
    return value


def _chat_tools(body: Mapping[str, Any]) -> dict[str, Any]:
    """Responses' flat function tools and tool_choice -> chat's nested ones."""
    out: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise InvalidRequest("tools must be a list", param="tools")
        converted = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else type(t).__name__
                raise InvalidRequest(f"tools[{i}]: only function tools are supported, got {kind!r}", param="tools")
            converted.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                                  "strict") if k in t}})
        out["tools"] = converted
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    return out


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"input[{i}].content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(f"input[{i}].content: only text parts are supported, got {kind!r}", param="input")
        texts.append(part["text"])
    return "".join(texts)


def parse_responses(body: Mapping[str, Any], model: ServedModel) -> ResponsesRequest:
    unknown = sorted(set(body) - _SERVED)
    if unknown:
        raise InvalidRequest(f"unsupported field {unknown[0]!r} on /v1/responses", param=unknown[0])
    if body.get("previous_response_id") is not None:
        raise InvalidRequest("previous_response_id is not supported: this server stores no responses; send the "
                             "conversation in input", param="previous_response_id")
    if body.get("include"):
        raise InvalidRequest("include is not supported", param="include")
    chat = {"model": body.get("model"), "messages": _messages(body), "stream": body.get("stream"), **_chat_tools(body),
            **{k: body[k] for k in ("temperature", "top_p", "seed") if body.get(k) is not None}}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    try:
        api = parse_chat(chat, model)
    except InvalidRequest as e:
        if e.param in ("max_tokens", "messages"):
            e.param = {"max_tokens": "max_output_tokens", "messages": "input"}[e.param]
        raise
    return ResponsesRequest(api, body)


def _response_format(text: Any) -> dict[str, Any] | None:
    """Responses' text.format (flat: {"type": "json_schema", "name", "schema", "strict"}) as chat's
    response_format (nested under "json_schema"), which structured outputs serve."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequest("text must be an object", param="text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        raise InvalidRequest("text.format.type must be text, json_schema or json_object", param="text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}


# --------------------------------------------------------------------------- responses


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _message(req: ResponsesRequest, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": req.message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress"
            else []}


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (tool_calls.call_dict) as a Responses output item."""
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def response_object(req: ResponsesRequest, model: ServedModel, result: ChoiceResult | None,
                    usage: Usage | None, calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The response object; result None means still in progress (the stream's first events).
    calls: the tool calls already parsed (streaming); else they are parsed from result.text."""
    body = req.body
    if result is None:
        status, output, incomplete = "in_progress", [], None
    else:
        text, finish = result.text, result.finish_reason
        if calls is None and req.api.tools is not None:
            message, finish = req.api.tools.message(text, finish)
            text, calls = message["content"] or "", message.get("tool_calls", [])
        cut = finish == "length"
        status = "incomplete" if cut else "completed"
        # The message item is always first (streaming announces it before any call is known).
        output = [_message(req, text, status), *(function_call_item(c) for c in calls or [])]
        incomplete = {"reason": "max_output_tokens"} if cut else None
    return {
        "id": req.response_id, "object": "response", "created_at": req.api.created, "status": status,
        "model": model.name, "output": output, "usage": _usage(usage), "error": None,
        "incomplete_details": incomplete, "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0), "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}}, "previous_response_id": None, "store": False,
        "metadata": body.get("metadata") or {}, "truncation": "disabled",
    }


class ResponseEvents:
    """The streaming events of one response, in the order the OpenAI SDK expects them."""

    def __init__(self, req: ResponsesRequest, model: ServedModel) -> None:
        self.req, self.model = req, model
        self.seq = 0
        self.result = ChoiceResult(index=0)
        self.text = ""  # the content streamed (tool-call text is not)
        self.calls: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> str:
        head = response_object(self.req, self.model, None, None)
        ids = {"item_id": self.req.message_id, "output_index": 0}
        return (self._event("response.created", response=head) + self._event("response.in_progress", response=head)
                + self._event("response.output_item.added", output_index=0,
                              item=_message(self.req, "", "in_progress"))
                + self._event("response.content_part.added", **ids, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def update(self, choices: list[ChoiceUpdate]) -> str:
        out = ""
        tools = self.req.api.tools
        for c in choices:
            self.result.add(c)
            text, calls = c.text, []
            if tools is not None:
                text, calls, finish = tools.delta(0, c.text, c.finish_reason)
                self.result.finish_reason = finish if c.finish_reason is not None else self.result.finish_reason
            self.text += text
            if text:
                out += self._event("response.output_text.delta", item_id=self.req.message_id, output_index=0,
                                   content_index=0, delta=text, logprobs=[])
            for call in calls:
                self.calls.append(call)
                item, index = function_call_item(call), len(self.calls)
                out += (self._event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                            "status": "in_progress"})
                        + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"])
                        + self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, arguments=item["arguments"])
                        + self._event("response.output_item.done", output_index=index, item=item))
        return out

    def finish(self, usage: Usage | None) -> str:
        shown = ChoiceResult(index=0, text=self.text, finish_reason=self.result.finish_reason)
        final = response_object(self.req, self.model, shown, usage, calls=self.calls)
        item = final["output"][0]
        ids = {"item_id": self.req.message_id, "output_index": 0, "content_index": 0}
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return (self._event("response.output_text.done", **ids, text=self.text, logprobs=[])
                + self._event("response.content_part.done", **ids, part=item["content"][0])
                + self._event("response.output_item.done", output_index=0, item=item)
                + self._event(kind, response=final))

    def error(self, error: dict[str, Any]) -> str:
        e = error.get("error", {})
        return self._event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
