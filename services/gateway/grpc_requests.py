"""gRPC `tandem.v1.GenerateRequest` -> the REST path's parsed request (openai_schemas.ApiRequest).

The same validation and the same shaping as REST: a prompt batch is one GenerationRequest per
prompt (ids "<request_id>-<i>"), `echo` uses completion_batch's helpers, chat with tools the same
ToolsRequest. Errors name the proto field ("sampling.max_tokens", "chat.tools_json", "prompt[2]").
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from common.sampling.params import SamplingParams, SamplingParamsError
from services.gateway import limits
from services.gateway.completion_batch import echo_params, echo_texts
from services.gateway.errors import InvalidRequest, NotFound
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import (MAX_BATCH_PROMPTS, ApiRequest, chat_messages, check_logit_bias,
                                             completion_prompt_ids, resolve_max_tokens)
from services.gateway.request_types import GenerationRequest
from services.gateway.tool_calls import ToolsRequest, constrain_tool_calls, parse_tools
from services.runtime.kv_wire import sampling_params_to_dict
from tandem.v1 import generation_pb2

DEFAULT_MAX_TOKENS = 16  # SamplingParams.max_tokens unset (common.proto), chat included


def check_model(name: str, model: ServedModel) -> None:
    if name and name != model.name:
        raise NotFound(f"the model {name!r} does not exist; this cluster serves {model.name!r}", param="model")


def _message(m: generation_pb2.ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def _json_field(text: str, name: str) -> Any:
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name} is not JSON: {e}", param=name) from None


def chat_tools(msg: generation_pb2.ChatMessages, model: ServedModel) -> ToolsRequest | None:
    body = {"tools": _json_field(msg.tools_json, "chat.tools_json"),
            "tool_choice": _json_field(msg.tool_choice_json, "chat.tool_choice_json")}
    if msg.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = msg.parallel_tool_calls
    try:
        return parse_tools(body, model.tool_call_parser, getattr(model.tokenizer, "chat_template", None))
    except InvalidRequest as e:  # name the proto field
        e.param = {"tools": "chat.tools_json", "tool_choice": "chat.tool_choice_json"}.get(e.param, f"chat.{e.param}")
        raise


def chat_ids(msg: generation_pb2.ChatMessages, model: ServedModel, tools: ToolsRequest | None = None) -> list[int]:
    messages = chat_messages([_message(m) for m in msg.messages])
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    limits.check_prompt_chars((m["content"] for m in messages), model, "chat")
    if tools is not None:
        return tools.render(model, messages)
    return model.tokenize_chat(messages, add_generation_prompt=add)


def _prompts(msg: generation_pb2.GenerateRequest, model: ServedModel) -> tuple[list[Any], list[list[int]]]:
    """(the client's prompts as given, their token ids) of a completion request."""
    which = msg.WhichOneof("prompt")
    if which == "batch":
        entries = list(msg.batch.prompts)
        if not entries or len(entries) > MAX_BATCH_PROMPTS:
            raise InvalidRequest(f"batch.prompts must hold 1 to {MAX_BATCH_PROMPTS} prompts, got {len(entries)}",
                                 param="prompt")
        raw = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(entries)]
        return raw, [completion_prompt_ids(p, model, f"prompt[{i}]") for i, p in enumerate(raw)]
    if which not in ("text", "token_ids"):
        raise InvalidRequest("exactly one of text, token_ids, chat or batch must be set", param="prompt")
    raw = [_one_prompt(msg, "prompt")]
    return raw, [completion_prompt_ids(raw[0], model)]


def _one_prompt(msg: Any, where: str) -> str | list[int]:
    which = msg.WhichOneof("prompt")
    if which == "text":
        return msg.text
    if which == "token_ids" and msg.token_ids.ids:
        return list(msg.token_ids.ids)
    if which == "token_ids":
        raise InvalidRequest(f"{where} must not be empty", param="prompt")
    raise InvalidRequest(f"{where}: one of text or token_ids must be set", param="prompt")


def _params(msg: generation_pb2.GenerateRequest, model: ServedModel, echo: bool) -> tuple[SamplingParams, bool, bool]:
    """(params, max_tokens explicit, scoring only). max_tokens 0 = up to the context, except with
    echo, where it scores the prompt alone (REST's max_tokens 0 with echo)."""
    fields = sampling_params_to_dict(msg.sampling)
    zero = msg.sampling.HasField("max_tokens") and msg.sampling.max_tokens == 0
    scoring_only = echo and zero
    if scoring_only:  # the engine generates >= 1 token; this one is dropped from the answer
        fields["max_tokens"] = 1
    elif zero:
        fields.pop("max_tokens", None)  # "up to the context": resolved per prompt
    try:
        params = SamplingParams.from_dict(fields)
    except SamplingParamsError as e:
        raise InvalidRequest(str(e), param=e.field) from None
    check_logit_bias(params, model)
    explicit = msg.sampling.HasField("max_tokens") and (scoring_only or not zero)
    return echo_params(params, echo), explicit, scoring_only


def api_request(msg: generation_pb2.GenerateRequest, model: ServedModel) -> ApiRequest:
    """The request as REST would have parsed it (stream left False: the rpc decides)."""
    check_model(msg.model, model)
    is_chat = msg.WhichOneof("prompt") == "chat"
    if is_chat and msg.echo:
        raise InvalidRequest("echo is only supported on completion prompts (text, token_ids, batch)", param="echo")
    tools, raw = None, []
    if is_chat:
        tools = chat_tools(msg.chat, model)
        prompts = [chat_ids(msg.chat, model, tools)]
        if not prompts[0]:
            raise InvalidRequest("prompt must not be empty", param="prompt")
    else:
        raw, prompts = _prompts(msg, model)
    params, explicit, scoring_only = _params(msg, model, msg.echo)
    params = constrain_tool_calls(params, tools)
    body = {"max_tokens": params.max_tokens} if explicit else {}
    unlimited = msg.sampling.HasField("max_tokens") and not explicit  # max_tokens 0 without echo
    default = None if unlimited else DEFAULT_MAX_TOKENS
    request_id = msg.request_id or f"gen-{uuid.uuid4().hex}"
    batch = msg.WhichOneof("prompt") == "batch"
    generations = [GenerationRequest(
        request_id=f"{request_id}-{i}" if batch else request_id, model=model.name, prompt_token_ids=ids,
        params=resolve_max_tokens(params, body, len(ids), model, "prompt", default),
        return_token_ids=msg.return_token_ids, disable_speculative_decoding=msg.disable_speculative_decoding,
        max_tokens_defaulted=not explicit, max_tokens_field="sampling.max_tokens",
    ) for i, ids in enumerate(prompts)]  # fmt: skip
    api = ApiRequest(generations, "chat" if is_chat else "completion", stream=False, include_usage=True,
                     response_id=request_id, created=0, echo=msg.echo, scoring_only=scoring_only, tools=tools)
    if msg.echo:
        api.prompt_texts = echo_texts(raw, prompts, model)
    return api
