"""The public gRPC `Generation` service: protobuf <-> domain, then the same orchestrator as REST.

Errors: every GatewayError becomes its gRPC code (errors.py) with the field leading the details
("temperature: must be >= 0.0, got -1"); bytes that are not a valid message (a string that is not
UTF-8) get INVALID_ARGUMENT naming the field (proto_decoding.py). Cancelling a Generate call
closes the update stream, which aborts the request on every worker.

Request ids are scoped to their caller: `Abort(request_id)` reaches only a request the same
caller started (on this gateway, or on another replica through the route record), and two
callers may use the same request id. The caller is its credential (a hash of the
`authorization` metadata) when it sends one, else its host (the gRPC peer's address without
the port): without API keys, anything on the same host counts as the same caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from typing import Any

import grpc
from google.protobuf import message_factory

from common.sampling.params import SamplingParams, SamplingParamsError
from services.gateway import limits, proto_decoding
from services.gateway.errors import GatewayError, InvalidRequest, NotFound
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import (check_token_ids, chat_messages, check_logit_bias, completion_prompt_ids,
                                             resolve_max_tokens)
from services.gateway.orchestrator import count_refusal
from services.gateway.request_types import (ChoiceUpdate, GenerationRequest, TokenLogprob, Usage, collect,
                                            prompt_logprobs_of)
from services.gateway.tool_calls import ToolsRequest, constrain_tool_calls, parse_tools
from services.runtime import tracing
from services.runtime.kv_wire import sampling_params_to_dict
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

_GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]

FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ERROR,
                  "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}


# --------------------------------------------------------------------------- proto -> domain

def _check_model(name: str, model: ServedModel) -> None:
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


def _chat(msg: generation_pb2.ChatMessages, model: ServedModel, tools: ToolsRequest | None = None) -> list[int]:
    messages = chat_messages([_message(m) for m in msg.messages])
    add = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    limits.check_prompt_chars((m["content"] for m in messages), model, "chat")
    if tools is not None:
        return tools.render(model, messages)
    return model.tokenize_chat(messages, add_generation_prompt=add)


def request_from_proto(msg: generation_pb2.GenerateRequest, model: ServedModel) -> GenerationRequest:
    req, _ = request_and_tools(msg, model)
    return req


def request_and_tools(msg: generation_pb2.GenerateRequest,
                      model: ServedModel) -> tuple[GenerationRequest, ToolsRequest | None]:
    _check_model(msg.model, model)
    which = msg.WhichOneof("prompt")
    tools = None
    if which == "text":
        ids = completion_prompt_ids(msg.text, model)
    elif which == "token_ids":
        ids = completion_prompt_ids(list(msg.token_ids.ids), model) if msg.token_ids.ids else []
    elif which == "chat":
        tools = chat_tools(msg.chat, model)
        ids = _chat(msg.chat, model, tools)
    else:
        raise InvalidRequest("exactly one of text, token_ids or chat must be set", param="prompt")
    if not ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    fields = sampling_params_to_dict(msg.sampling)
    unlimited = msg.sampling.HasField("max_tokens") and msg.sampling.max_tokens == 0
    if unlimited:
        fields.pop("max_tokens", None)  # 0 = "up to the context": resolved below
    try:
        params = SamplingParams.from_dict(fields)
    except SamplingParamsError as e:
        raise InvalidRequest(str(e), param=e.field) from None
    check_logit_bias(params, model)
    params = constrain_tool_calls(params, tools)
    explicit = {"max_tokens": params.max_tokens} if msg.sampling.HasField("max_tokens") and not unlimited else {}
    params = resolve_max_tokens(params, explicit, len(ids), model, "prompt", None if unlimited else 16)
    return GenerationRequest(
        request_id=msg.request_id or f"gen-{uuid.uuid4().hex}", model=model.name, prompt_token_ids=ids,
        params=params, return_token_ids=msg.return_token_ids,
        disable_speculative_decoding=msg.disable_speculative_decoding, max_tokens_defaulted=not explicit,
        max_tokens_field="sampling.max_tokens",
    ), tools


def caller_identity(context: grpc.aio.ServicerContext) -> str:
    """An opaque id of who is calling: their credential if they send one, else their host."""
    credential = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None)
    host = (context.peer() or "").rpartition(":")[0]  # "ipv4:10.0.0.7:53210" -> "ipv4:10.0.0.7"
    who = f"key:{credential}" if credential is not None else f"host:{host}"
    return hashlib.sha256(who.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server with lenient request decoding."""
    handlers = {}
    for method in _GENERATION.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        behaviour = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        guard = proto_decoding.guard_stream if method.server_streaming else proto_decoding.guard_unary
        handlers[method.name] = make(guard(behaviour), request_deserializer=proto_decoding.lenient(request_class),
                                     response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GENERATION.full_name, handlers),))
    server.add_registered_method_handlers(_GENERATION.full_name, handlers)


# --------------------------------------------------------------------------- domain -> proto

def _logprobs_to_proto(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [common_pb2.TokenLogprob(
        token_id=lp.token_id, token=lp.token, logprob=lp.logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t.token_id, token=t.token, logprob=t.logprob)
                      for t in lp.top_logprobs]) for lp in logprobs or []]


def _stop_reason(target: Any, reason: str | None, stop_reason: int | str | None) -> None:
    if reason == "stop" and isinstance(stop_reason, str):
        target.stop_string = stop_reason
    elif reason == "stop" and isinstance(stop_reason, int):
        target.stop_token_id = stop_reason


def delta_to_proto(c: ChoiceUpdate, tools: ToolsRequest | None = None) -> generation_pb2.ChoiceDelta:
    text, calls, finish = tools.delta(c.index, c.text, c.finish_reason) if tools is not None \
        else (c.text, [], c.finish_reason)
    delta = generation_pb2.ChoiceDelta(index=c.index, token_ids=c.token_ids, text=text,
                                       logprobs=_logprobs_to_proto(c.logprobs),
                                       finish_reason=FINISH_REASONS.get(finish or "", 0),
                                       tool_calls=[_call_to_proto(d) for d in calls])
    _stop_reason(delta, c.finish_reason, c.stop_reason)
    return delta


def _call_to_proto(call: dict[str, Any]) -> generation_pb2.ToolCall:
    fn = call["function"]
    return generation_pb2.ToolCall(id=call["id"], name=fn["name"], arguments=fn["arguments"])


def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                            total_tokens=usage.total_tokens, cached_tokens=usage.cached_tokens)


# --------------------------------------------------------------------------- servicer

@contextlib.asynccontextmanager
async def _status(context: grpc.aio.ServicerContext, metrics: Any = None):
    """The one place a GatewayError turns into a gRPC status (counted when metrics is given)."""
    try:
        yield
    except GatewayError as e:
        if metrics is not None:
            count_refusal(metrics, e)
        await context.abort(e.grpc_code, e.grpc_details())


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway
        self.model: ServedModel = gateway.model

    def _request(self, msg: generation_pb2.GenerateRequest,
                 context: grpc.aio.ServicerContext) -> tuple[GenerationRequest, ToolsRequest | None]:
        req, tools = request_and_tools(msg, self.model)
        req.owner = caller_identity(context)
        return limits.check_request(req, self.model, self.gateway.limits, self.gateway.kv_capacity()), tools

    async def Generate(self, request, context):
        async with _status(context, self.gateway.metrics):
            req, tools = self._request(request, context)
            updates = self.gateway.orchestrator.generate(
                req, trace_parent=tracing.context_from_grpc(context), span_name="tandem.v1.Generation/Generate")
            async with contextlib.aclosing(updates):
                first = True
                async for update in updates:
                    msg = generation_pb2.GenerateResponse(
                        request_id=req.request_id, choices=[delta_to_proto(c, tools) for c in update.choices])
                    if first and req.return_token_ids:
                        msg.prompt_token_ids.extend(req.prompt_token_ids)
                    if update.usage is not None:
                        msg.usage.CopyFrom(usage_to_proto(update.usage))
                    if update.prompt_logprobs:
                        msg.prompt_logprobs.extend(_logprobs_to_proto(update.prompt_logprobs))
                    first = False
                    yield msg

    async def Complete(self, request, context):
        async with _status(context, self.gateway.metrics):
            req, tools = self._request(request, context)
            updates = self.gateway.orchestrator.generate(
                req, trace_parent=tracing.context_from_grpc(context), span_name="tandem.v1.Generation/Complete")
            async with contextlib.aclosing(updates):
                got = [u async for u in updates]
            results, usage = collect(got, req.params.n)
            response = generation_pb2.CompleteResponse(request_id=req.request_id, usage=usage_to_proto(usage),
                                                       prompt_logprobs=_logprobs_to_proto(prompt_logprobs_of(got)))
            for r in results:
                text, finish, calls = r.text, r.finish_reason, []
                if tools is not None:
                    message, finish = tools.message(r.text, r.finish_reason)
                    text, calls = message["content"] or "", message.get("tool_calls", [])
                choice = response.choices.add(index=r.index, text=text, logprobs=_logprobs_to_proto(r.logprobs),
                                              finish_reason=FINISH_REASONS.get(finish or "", 0),
                                              tool_calls=[_call_to_proto(c) for c in calls])
                if req.return_token_ids:
                    choice.token_ids.extend(r.token_ids)
                _stop_reason(choice, r.finish_reason, r.stop_reason)
            if req.return_token_ids:
                response.prompt_token_ids.extend(req.prompt_token_ids)
            return response

    async def Tokenize(self, request, context):
        async with _status(context):
            _check_model(request.model, self.model)
            which = request.WhichOneof("input")
            if which == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.model.tokenize(request.text, add_special_tokens=add)
            elif which == "chat":
                ids = _chat(request.chat, self.model)
            else:
                raise InvalidRequest("one of text or chat must be set", param="input")
            return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.model.token_strings(ids),
                                                   max_model_len=self.model.max_model_len)

    async def Detokenize(self, request, context):
        async with _status(context):
            _check_model(request.model, self.model)
            ids = check_token_ids(list(request.token_ids), self.model, "token_ids")
            return generation_pb2.DetokenizeResponse(text=self.model.tokenizer.decode(ids))

    async def ListModels(self, request, context):
        m = self.model
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=m.name, owned_by="tandem", created=m.created, max_model_len=m.max_model_len)])

    async def Abort(self, request, context):
        aborted = await self.gateway.orchestrator.abort(request.request_id, request.reason or "Abort rpc",
                                                        owner=caller_identity(context))
        return common_pb2.AbortResponse(aborted=aborted)
