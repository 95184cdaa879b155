"""Tool-call parsers: a model's raw output text -> (content, tool calls), whole or incrementally.

One interface, one class per output format (chosen per model from its chat template, or by the
gateway's --tool-call-parser flag):

    hermes       Hermes / Qwen2.5 / SmolLM2-style: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
                 any number of them, with free text around (the text is the content).
    llama3_json  Llama 3.x: the whole answer is a JSON object {"name": ..., "parameters": {...}} (or
                 "arguments"), optionally after <|python_tag|>, several separated by ";".
    json_block   fenced JSON: ```json {"name": ..., "arguments": {...}} ``` (or an array of such
                 objects), as Qwen2.5-Coder-0.5B-Instruct writes its calls; a block is a call only
                 when every name in it is one of the request's tools, so code answers that merely
                 contain JSON stay content.
    qwen         Qwen2.5 templates (auto's choice for them): hermes tags, and json_block on the text
                 around them.

`parse(text)` reads a finished answer; `stream()` returns an incremental parser whose `feed(delta)`
returns the content that is certainly content and the calls completed so far, holding back any
text that may still turn into a call (a partial "<tool_call>" tag, an unfinished call). A call that
does not parse as JSON with a string name stays content: nothing the model wrote is dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection
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


def parse_by_stream(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer through the parser's incremental form (one code path for both)."""
    s = parser.stream()
    content, calls = s.feed(text)
    rest, more = s.finish()
    return (content + rest).strip(), calls + more


class HermesParser:
    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        pass  # every well-formed tagged call is a call (the tags say so), whatever its name

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_by_stream(self, text)

    def stream(self) -> StreamParser:
        return _TaggedStream(self.open_tag, self.close_tag, _json_calls)


@dataclass
class _TaggedStream:
    """Text with calls between an open and a close marker; `decode` turns what is between them
    into calls (None: not a call, kept as content with its markers)."""

    open_tag: str
    close_tag: str
    decode: Callable[[str], list[ToolCall] | None]
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
            end = self.buffer.find(self.close_tag, len(self.open_tag))  # a fence opens and closes alike
            if end < 0:
                return content, calls
            found = self.decode(self.buffer[len(self.open_tag):end])
            if found is None:  # not a call after all: keep the model's text as content
                content += self.buffer[: end + len(self.close_tag)]
            else:
                calls.extend(found)
            self.buffer = self.buffer[end + len(self.close_tag):]
            self.inside = False

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.inside:  # an unclosed call (cut by max_tokens, or a model that omits the tag)
            self.inside = False
            found = self.decode(rest[len(self.open_tag):])
            if found is not None:
                return "", found
        return rest, []


def _json_calls(raw: str) -> list[ToolCall] | None:
    try:
        call = call_from_json(json.loads(raw.strip()))
    except json.JSONDecodeError:
        return None
    return None if call is None else [call]


# --------------------------------------------------------------------------- fenced json blocks


class JsonBlockParser:
    name = "json_block"
    fence = "```"

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self.tool_names = frozenset(tool_names)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_by_stream(self, text)

    def stream(self) -> StreamParser:
        return _TaggedStream(self.fence, self.fence, self.block_calls)

    def block_calls(self, raw: str) -> list[ToolCall] | None:
        """The inside of a fence (a language line such as json, then the JSON) -> its calls; None
        unless it is a JSON object or a non-empty array of objects that are all declared tools' calls."""
        body = raw.strip()
        lang, _, rest = body.partition("\n")
        if lang.strip().lower() in ("json", "tool_call", "tool_code"):
            body = rest
        return self.declared_calls(body)

    def declared_calls(self, text: str) -> list[ToolCall] | None:
        """JSON text -> its calls when it is one call or an array of calls, all of declared tools."""
        try:
            obj = json.loads(text.strip())
        except json.JSONDecodeError:
            return None
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from_json(i) for i in items]
        if not calls or any(c is None or c.name not in self.tool_names for c in calls):
            return None
        return calls  # type: ignore[return-value]


class QwenParser:
    name = "qwen"

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        self.tags = HermesParser(tool_names)
        self.blocks = JsonBlockParser(tool_names)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return parse_by_stream(self, text)

    def stream(self) -> StreamParser:
        # Tags, then fences in the text around them, then an answer that is only a bare JSON call
        # (Qwen2.5-Coder writes that too), each accepting only declared tools' calls.
        bare = _WholeAnswerStream(_BareCalls(self.blocks), ("{", "["))
        return _ChainedStream(self.tags.stream(), _ChainedStream(self.blocks.stream(), bare))


@dataclass
class _BareCalls:
    """An answer that is nothing but a JSON call (or array of calls) of declared tools."""

    blocks: JsonBlockParser

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = self.blocks.declared_calls(text)
        return ("", calls) if calls else (text, [])


@dataclass
class _ChainedStream:
    """The first parser's content goes through the second: calls of either kind come out."""

    first: StreamParser
    second: StreamParser

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        content, calls = self.first.feed(delta)
        content, more = self.second.feed(content)
        return content, calls + more

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, calls = self.first.finish()
        content, more = self.second.feed(rest)
        tail, last = self.second.finish()
        return content + tail, calls + more + last


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

    def __init__(self, tool_names: Collection[str] = ()) -> None:
        pass  # the whole answer is the call: there is no surrounding prose to confuse with one

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
        return _WholeAnswerStream(self, ("{", self.python_tag))


@dataclass
class _WholeAnswerStream:
    """Streams content at once unless the answer may be a call (starts with one of `starts`, e.g.
    "{" or the python tag): that is only known at the end, so it is held until finish()."""

    parser: Any  # parse(text) -> (content, calls) of a whole answer
    starts: tuple[str, ...]
    buffer: str = ""
    decided: bool | None = None  # True: content; False: maybe calls (held)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.decided is True:
            return delta, []
        self.buffer += delta
        head = self.buffer.lstrip()
        if not head:
            return "", []
        if any(head.startswith(start) or start.startswith(head) for start in self.starts):
            self.decided = False
            return "", []
        self.decided = True
        out, self.buffer = self.buffer, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        return self.parser.parse(rest) if rest else ("", [])


PARSERS: dict[str, type] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "json_block": JsonBlockParser,
                            "qwen": QwenParser}


def parser_for(name: str, chat_template: str | None, tool_names: Collection[str] = ()) -> ToolParser:
    """name: a PARSERS key, or "auto": read the chat template (Llama 3's python tag / ipython role
    -> llama3_json; Qwen2.5's, with <|im_start|> and <tool_call> -> qwen; anything else, Hermes'
    included -> hermes). tool_names: the request's tools (json_block accepts only those)."""
    if name == "auto":
        template = chat_template or ""
        if "<|python_tag|>" in template or "ipython" in template:
            name = "llama3_json"
        elif "<|im_start|>" in template and "<tool_call>" in template:
            name = "qwen"
        else:
            name = "hermes"
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(PARSERS)} or auto")
    return PARSERS[name](tool_names)
