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
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import message_factory

from services.gateway import limits, proto_decoding
from services.gateway.completion_batch import BatchShaper, merge
from services.gateway.errors import GatewayError, InvalidRequest
from services.gateway.grpc_requests import api_request, chat_ids, check_model
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import ApiRequest, check_token_ids
from services.gateway.orchestrator import count_refusal
from services.gateway.request_types import (ChoiceResult, ChoiceUpdate, GenerationUpdate, TokenLogprob, Usage,
                                            scoped_id)
from services.gateway.tool_calls import ToolsRequest
from services.runtime import tracing
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

_GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"]

FINISH_REASONS = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT, "error": common_pb2.FINISH_REASON_ERROR,
                  "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}


# --------------------------------------------------------------------------- callers

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
        token_id=lp.token_id, token=lp.token, logprob=lp.logprob or 0.0, no_logprob=lp.logprob is None,
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
        self._batches: dict[str, list[str]] = {}  # scoped batch id -> its prompts' request ids, while running

    def _request(self, msg: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> ApiRequest:
        api = api_request(msg, self.model)
        owner = caller_identity(context)
        for g in api.generations:
            g.owner = owner
        api.generations = [limits.check_request(g, self.model, self.gateway.limits, self.gateway.kv_capacity())
                           for g in api.generations]
        return api

    @contextlib.asynccontextmanager
    async def _run(self, msg: generation_pb2.GenerateRequest, api: ApiRequest, context: grpc.aio.ServicerContext,
                   span: str) -> AsyncIterator[AsyncIterator[tuple[int, GenerationUpdate]]]:
        """The merged updates of every prompt; a batch is abortable by its request id meanwhile."""
        trace_parent = tracing.context_from_grpc(context)
        updates = merge([self.gateway.orchestrator.generate(g, trace_parent=trace_parent, span_name=span)
                         for g in api.generations])
        batch_key = scoped_id(api.generation.owner, api.response_id) if msg.HasField("batch") else None
        if batch_key is not None:
            self._batches[batch_key] = [g.request_id for g in api.generations]
        try:
            async with contextlib.aclosing(updates):
                yield updates
        finally:
            if batch_key is not None:
                self._batches.pop(batch_key, None)

    async def Generate(self, request, context):
        async with _status(context, self.gateway.metrics):
            api = self._request(request, context)
            async with self._run(request, api, context, "tandem.v1.Generation/Generate") as updates:
                shaping, started = BatchShaper(api, self.model), set()
                async for i, update in updates:
                    choices = shaping.shape(i, update)
                    msg = generation_pb2.GenerateResponse(
                        request_id=api.response_id, prompt_index=i,
                        choices=[delta_to_proto(c, api.tools) for c in choices])
                    if i not in started and api.generations[i].return_token_ids:
                        msg.prompt_token_ids.extend(api.generations[i].prompt_token_ids)
                    started.add(i)
                    if update.prompt_logprobs:
                        msg.prompt_logprobs.extend(_logprobs_to_proto(update.prompt_logprobs))
                    if shaping.finished:
                        msg.usage.CopyFrom(usage_to_proto(shaping.usage))
                    yield msg

    async def Complete(self, request, context):
        async with _status(context, self.gateway.metrics):
            api = self._request(request, context)
            async with self._run(request, api, context, "tandem.v1.Generation/Complete") as updates:
                got = [u async for u in updates]
            shaping = BatchShaper(api, self.model)
            results = shaping.results(got, api.num_choices)
            response = generation_pb2.CompleteResponse(request_id=api.response_id,
                                                       choices=[self._choice(r, api) for r in results])
            if shaping.usage is not None:
                response.usage.CopyFrom(usage_to_proto(shaping.usage))
            prompts = [generation_pb2.PromptResult(
                prompt_token_ids=g.prompt_token_ids if g.return_token_ids else [],
                prompt_logprobs=_logprobs_to_proto(lps)) for g, lps in zip(api.generations, shaping.prompt_logprobs)]
            response.prompt_token_ids.extend(prompts[0].prompt_token_ids)
            response.prompt_logprobs.extend(prompts[0].prompt_logprobs)
            if request.HasField("batch"):
                response.prompts.extend(prompts)
            return response

    @staticmethod
    def _choice(r: ChoiceResult, api: ApiRequest) -> generation_pb2.Choice:
        text, finish, calls = r.text, r.finish_reason, []
        if api.tools is not None:
            message, finish = api.tools.message(r.text, r.finish_reason)
            text, calls = message["content"] or "", message.get("tool_calls", [])
        choice = generation_pb2.Choice(index=r.index, text=text, logprobs=_logprobs_to_proto(r.logprobs),
                                       finish_reason=FINISH_REASONS.get(finish or "", 0),
                                       tool_calls=[_call_to_proto(c) for c in calls],
                                       token_ids=r.token_ids if api.generation.return_token_ids else [])
        _stop_reason(choice, r.finish_reason, r.stop_reason)
        return choice

    async def Tokenize(self, request, context):
        async with _status(context):
            check_model(request.model, self.model)
            which = request.WhichOneof("input")
            if which == "text":
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.model.tokenize(request.text, add_special_tokens=add)
            elif which == "chat":
                ids = chat_ids(request.chat, self.model)
            else:
                raise InvalidRequest("one of text or chat must be set", param="input")
            return generation_pb2.TokenizeResponse(token_ids=ids, tokens=self.model.token_strings(ids),
                                                   max_model_len=self.model.max_model_len)

    async def Detokenize(self, request, context):
        async with _status(context):
            check_model(request.model, self.model)
            ids = check_token_ids(list(request.token_ids), self.model, "token_ids")
            return generation_pb2.DetokenizeResponse(text=self.model.tokenizer.decode(ids))

    async def ListModels(self, request, context):
        m = self.model
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=m.name, owned_by="tandem", created=m.created, max_model_len=m.max_model_len)])

    async def Abort(self, request, context):
        owner, reason = caller_identity(context), request.reason or "Abort rpc"
        ids = self._batches.get(scoped_id(owner, request.request_id), [request.request_id])
        aborted = [await self.gateway.orchestrator.abort(i, reason, owner=owner) for i in ids]
        return common_pb2.AbortResponse(aborted=any(aborted))
