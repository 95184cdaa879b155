"""Tool-call parsers: a model's raw output text -> (content, tool calls), whole or incrementally.

One interface, one class per output format (chosen per model from its chat template, or by the
gateway's --tool-call-parser flag):

    hermes       Hermes / Qwen2.5 / SmolLM2-style: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
                 any number of them, with free text around (the text is the content).
    llama3_json  Llama 3.x: the whole answer is a JSON object {"name": ..., "parameters": {...}} (or
                 "arguments"), optionally after <|python_tag|>, several separated by ";".

`parse(text)` reads a finished answer; `stream()` returns an incremental parser whose `feed(delta)`
returns the content that is certainly content and the calls completed so far, holding back any
text that may still turn into a call (a partial "<tool_call>" tag, an unfinished call). A call that
does not parse as JSON with a string name stays content: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def call_from_json(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """{"name": str, "arguments"|"parameters": object|str} -> ToolCall; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class StreamParser(Protocol):
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]: ...

    def finish(self) -> tuple[str, list[ToolCall]]: ...


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...

    def stream(self) -> StreamParser: ...


# --------------------------------------------------------------------------- hermes


class HermesParser:
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        s = self.stream()
        content, calls = s.feed(text)
        rest, more = s.finish()
        return (content + rest).strip(), calls + more

    def stream(self) -> StreamParser:
        return _HermesStream(self.open_tag, self.close_tag)


@dataclass
class _HermesStream:
    open_tag: str
    close_tag: str
    buffer: str = ""
    inside: bool = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.inside:
                at = self.buffer.find(self.open_tag)
                if at < 0:
                    keep = _partial_suffix(self.buffer, self.open_tag)  # may be the start of a tag
                    content += self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self.buffer[:at]
                self.buffer = self.buffer[at:]
                self.inside = True
            end = self.buffer.find(self.close_tag)
            if end < 0:
                return content, calls
            raw = self.buffer[len(self.open_tag):end]
            call = _json_call(raw)
            if call is None:  # not a call after all: keep the model's text as content
                content += self.buffer[: end + len(self.close_tag)]
            else:
                calls.append(call)
            self.buffer = self.buffer[end + len(self.close_tag):]
            self.inside = False

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.inside:  # an unclosed call (cut by max_tokens, or a model that omits the tag)
            self.inside = False
            call = _json_call(rest[len(self.open_tag):])
            if call is not None:
                return "", [call]
        return rest, []


def _json_call(raw: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(raw.strip()))
    except json.JSONDecodeError:
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# --------------------------------------------------------------------------- llama 3 json


class Llama3JsonParser:
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return text, []
            call = call_from_json(obj)
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        return "", calls

    def stream(self) -> StreamParser:
        return _WholeAnswerStream(self)


@dataclass
class _WholeAnswerStream:
    """Streams content at once unless the answer may be a call (starts with "{" or the python tag):
    that is only known at the end, so it is held until finish()."""

    parser: Llama3JsonParser
    buffer: str = ""
    decided: bool | None = None  # True: content; False: maybe calls (held)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.decided is True:
            return delta, []
        self.buffer += delta
        head = self.buffer.lstrip()
        if not head:
            return "", []
        tag = self.parser.python_tag
        if head.startswith("{") or head.startswith(tag) or tag.startswith(head):
            self.decided = False
            return "", []
        self.decided = True
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        return self.parser.parse(rest) if rest else ("", [])


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def parser_for(name: str, chat_template: str | None) -> ToolParser:
    """name: a PARSERS key, or "auto": read the chat template (Llama 3's python tag / ipython role
    -> llama3_json; anything else, Qwen's and Hermes' <tool_call> included -> hermes)."""
    if name == "auto":
        template = chat_template or ""
        name = "llama3_json" if ("<|python_tag|>" in template or "ipython" in template) else "hermes"
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)} or auto")
    return PARSERS[name]()
