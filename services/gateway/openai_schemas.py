"""OpenAI request bodies -> GenerationRequest, and GenerationUpdates -> OpenAI response bodies.

Validation names the offending field in `param` (InvalidRequest -> 400); sampling ranges are
SamplingParams' own checks (SamplingParamsError names the field). Context-length rules:
    len(prompt) >= max_model_len                 -> 413 param "prompt" / "messages"
    len(prompt) + max_tokens > max_model_len     -> 400 param "max_tokens"
    max_tokens unset: completions 16 (capped to the room left), chat: all the room left
Unknown top-level fields are ignored (clients send extras such as `user`); fields we cannot honour
(`echo`, `suffix`, `best_of` > n, a batch of prompts) are rejected by name.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.sampling.params import SamplingParams, SamplingParamsError
from services.gateway import limits
from services.gateway.errors import InvalidRequest, MalformedBody, NotFound, PromptTooLong
from services.gateway.model import ServedModel
from services.gateway.request_types import (ChoiceResult, ChoiceUpdate, GenerationRequest, TokenLogprob,
                                            Usage)
from services.gateway.structured import grammar_from_body

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_COMMON_SAMPLING = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output",
)  # fmt: skip
COMPLETION_SAMPLING = (*_COMMON_SAMPLING, "logprobs")
CHAT_SAMPLING = (*_COMMON_SAMPLING, "logprobs", "top_logprobs", "max_completion_tokens")
# OpenAI's roles (function: its deprecated name of tool); anything else is a client bug.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass(slots=True)
class ApiRequest:
    """A parsed REST request: the domain request plus how to shape the answer."""

    generation: GenerationRequest
    kind: str  # "completion" | "chat"
    stream: bool
    include_usage: bool
    response_id: str
    created: int


# --------------------------------------------------------------------------- body

def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> JSON object. Non-UTF-8 or malformed JSON: 422; a non-object: 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedBody(f"the request body is not valid UTF-8 (byte {e.start})", param="body",
                            code="invalid_encoding") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedBody(f"the request body is not valid JSON: {e}", param="body", code="invalid_json") from None
    except RecursionError:
        raise limits.depth_error() from None
    if not isinstance(body, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(body).__name__}", param="body")
    limits.check_json(body)
    return body


def check_model(body: Mapping[str, Any], model: ServedModel) -> None:
    name = body.get("model")
    if name in (None, ""):
        return  # one model per cluster: absent means the served one
    if not isinstance(name, str):
        raise InvalidRequest(f"model must be a string, got {name!r}", param="model")
    if name != model.name:
        raise NotFound(f"the model {name!r} does not exist; this cluster serves {model.name!r}",
                       param="model", code="model_not_found")


def _bool_field(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequest(f"stream_options must be an object, got {options!r}", param="stream_options")
    if not stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
    return _bool_field(options, "include_usage")


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("echo"):
        raise InvalidRequest("echo is not supported", param="echo")
    if body.get("suffix") not in (None, ""):
        raise InvalidRequest("suffix is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise InvalidRequest("best_of other than n is not supported", param="best_of")


def _sampling(body: Mapping[str, Any], names: Sequence[str]) -> SamplingParams:
    fields = {k: body[k] for k in names if k in body}
    fields["grammar"] = grammar_from_body(body)  # response_format / structured_outputs / guided_*
    try:
        return SamplingParams.from_dict(fields)
    except SamplingParamsError as e:
        raise InvalidRequest(str(e), param=e.field) from None
    except TypeError as e:  # a value of a type the dataclass cannot even hold
        raise InvalidRequest(str(e), param="body") from None


def resolve_max_tokens(params: SamplingParams, body: Mapping[str, Any], prompt_len: int, model: ServedModel,
                        prompt_field: str, default: int | None) -> SamplingParams:
    room = model.max_model_len - prompt_len
    if room < 1:
        raise PromptTooLong(f"the prompt has {prompt_len} tokens, but this model's context is "
                            f"{model.max_model_len} tokens (prompt + at least 1 output token must fit)",
                            param=prompt_field, code="context_length_exceeded")
    explicit = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
    if not explicit:
        max_tokens = room if default is None else min(default, room)
        try:
            return SamplingParams(**{**_as_kwargs(params), "max_tokens": max_tokens})
        except SamplingParamsError as e:  # e.g. min_tokens > the room left
            raise InvalidRequest(str(e), param=e.field) from None
    if params.max_tokens > room:
        name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
        raise InvalidRequest(f"prompt ({prompt_len} tokens) + {name} ({params.max_tokens}) exceeds the context "
                             f"length {model.max_model_len}", param=name, code="context_length_exceeded")
    return params


def _as_kwargs(params: SamplingParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}


def _token_ids(value: Any, model: ServedModel, param: str) -> list[int]:
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequest(f"{param}[{i}] must be a token id (int), got {t!r}", param=param)
        if not 0 <= t < model.vocab_size:
            raise InvalidRequest(f"{param}[{i}] = {t} is outside the vocabulary [0, {model.vocab_size})",
                                 param=param)
    return list(value)


def completion_prompt_ids(prompt: Any, model: ServedModel) -> list[int]:
    """prompt: a string, a list of token ids, or a batch of one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        limits.check_prompt_chars([prompt], model, "prompt")
        ids = model.tokenize(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest("a batch of prompts is not supported; send one prompt per request", param="prompt")
    elif isinstance(prompt, list):
        limits.check_token_count(len(prompt), model, "prompt")
        ids = _token_ids(prompt, model, "prompt")
    elif prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    else:
        raise InvalidRequest(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}",
                             param="prompt")
    if not ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    return ids


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Checks the messages and flattens text content parts into one string per message."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                 param="messages")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        message = {"role": role, "content": content}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_completion(body: Mapping[str, Any], model: ServedModel) -> ApiRequest:
    check_model(body, model)
    _reject_unsupported(body)
    if isinstance(body.get("logprobs"), bool):
        raise InvalidRequest("logprobs must be an int (how many top alternatives) for completions",
                             param="logprobs")
    params = _sampling(body, COMPLETION_SAMPLING)
    ids = completion_prompt_ids(body.get("prompt"), model)
    params = resolve_max_tokens(params, body, len(ids), model, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return _api_request(body, model, ids, params, "completion", "cmpl")


def parse_chat(body: Mapping[str, Any], model: ServedModel) -> ApiRequest:
    check_model(body, model)
    _reject_unsupported(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean for chat (use top_logprobs for how many), got "
                             f"{logprobs!r}", param="logprobs")
    params = _sampling(body, CHAT_SAMPLING)
    messages = chat_messages(body.get("messages"))
    limits.check_prompt_chars((m["content"] for m in messages), model, "messages")
    ids = model.tokenize_chat(messages)
    if not ids:
        raise InvalidRequest("the rendered chat prompt is empty", param="messages")
    params = resolve_max_tokens(params, body, len(ids), model, "messages", None)
    return _api_request(body, model, ids, params, "chat", "chatcmpl")


def _api_request(body: Mapping[str, Any], model: ServedModel, ids: list[int], params: SamplingParams,
                 kind: str, prefix: str) -> ApiRequest:
    stream = _bool_field(body, "stream")
    include_usage = _stream_options(body, stream)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    generation = GenerationRequest(
        request_id=request_id, model=model.name, prompt_token_ids=ids, params=params,
        return_token_ids=_bool_field(body, "return_token_ids"),
        max_tokens_defaulted=body.get("max_tokens") is None and body.get("max_completion_tokens") is None,
        max_tokens_field="max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens",
    )
    return ApiRequest(generation, kind, stream, include_usage, request_id, int(time.time()))


# --------------------------------------------------------------------------- responses

def usage_dict(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def completion_logprobs(logprobs: list[TokenLogprob] | None, text_offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists plus per-position top-N dicts."""
    if logprobs is None:
        return None
    offsets, pos = [], text_offset
    for lp in logprobs:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top_logprobs} for lp in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [
        {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t.token, t.logprob) for t in lp.top_logprobs]}
        for lp in logprobs
    ]}


def _head(api: ApiRequest, model: ServedModel, chunk: bool) -> dict[str, Any]:
    obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
    return {"id": api.response_id, "object": obj[api.kind], "created": api.created, "model": model.name}


def full_response(api: ApiRequest, model: ServedModel, results: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
    choices = []
    for r in results:
        if api.kind == "completion":
            choice = {"index": r.index, "text": r.text, "logprobs": completion_logprobs(r.logprobs),
                      "finish_reason": r.finish_reason, "stop_reason": r.stop_reason}
        else:
            choice = {"index": r.index, "message": {"role": "assistant", "content": r.text},
                      "logprobs": chat_logprobs(r.logprobs), "finish_reason": r.finish_reason,
                      "stop_reason": r.stop_reason}
        if api.generation.return_token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    out = {**_head(api, model, chunk=False), "choices": choices, "usage": usage_dict(usage)}
    if api.generation.return_token_ids:
        out["prompt_token_ids"] = api.generation.prompt_token_ids
    return out


class ChunkWriter:
    """Streaming: one `data: {...}` SSE event per update, then usage and `data: [DONE]`; or an
    error event, and nothing after it."""

    def __init__(self, api: ApiRequest, model: ServedModel) -> None:
        self.api = api
        self.model = model
        self.role_sent: set[int] = set()
        self.text_offsets: dict[int, int] = {}
        self.first = True

    def _event(self, obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def update(self, choices: list[ChoiceUpdate]) -> str:
        out = []
        for c in choices:
            if self.api.kind == "completion":
                offset = self.text_offsets.get(c.index, 0)
                choice = {"index": c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs, offset),
                          "finish_reason": c.finish_reason}
                self.text_offsets[c.index] = offset + sum(len(lp.token) for lp in c.logprobs or [])
            else:
                delta: dict[str, Any] = {}
                if c.index not in self.role_sent:
                    delta["role"] = "assistant"
                    self.role_sent.add(c.index)
                if c.text or c.finish_reason is None:
                    delta["content"] = c.text
                choice = {"index": c.index, "delta": delta, "logprobs": chat_logprobs(c.logprobs),
                          "finish_reason": c.finish_reason}
            if c.finish_reason is not None:
                choice["stop_reason"] = c.stop_reason
            if self.api.generation.return_token_ids:
                choice["token_ids"] = c.token_ids
            obj = {**_head(self.api, self.model, chunk=True), "choices": [choice]}
            if self.first and self.api.generation.return_token_ids:
                obj["prompt_token_ids"] = self.api.generation.prompt_token_ids
            self.first = False
            if self.api.include_usage:
                obj["usage"] = None
            out.append(self._event(obj))
        return "".join(out)

    def finish(self, usage: Usage | None) -> str:
        out = ""
        if self.api.include_usage and usage is not None:
            out = self._event({**_head(self.api, self.model, chunk=True), "choices": [],
                               "usage": usage_dict(usage)})
        return out + "data: [DONE]\n\n"

    def error(self, error: dict[str, Any]) -> str:
        # No [DONE] after an error: [DONE] tells the client the answer is complete, and it is not.
        return self._event(error)
