"""The served OpenAPI document (GET /openapi.json): the real request bodies, for clients and fuzzers.

The handlers parse bodies themselves (openai_schemas.py: field-named 400s, limits before
parsing), so FastAPI cannot infer them; these pydantic models only *describe* them, with the
same bounds the parser enforces (context length, vocabulary, --max-n filled in from the served
model and the settings). tests/services/test_gateway_openapi.py checks that every sampling field
the parser reads is documented here, and fuzzes the served document with schemathesis.
A field another change adds to the parser belongs in these models too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, create_model

from common.sampling.params import MAX_LOGPROBS
from services.gateway.limits import MAX_TEMPERATURE, RequestLimits
from services.gateway.model import ServedModel
from services.gateway.openai_schemas import CHAT_ROLES

INT64 = 2**63 - 1
_ERROR_STATUSES = {
    "400": "A bad field; `param` names it.", "404": "Unknown model.",
    "413": "The body, or the prompt, is too large.", "422": "The body is not UTF-8 JSON.",
    "429": "The admission queue is full.", "503": "No decode worker is available.",
    "504": "The request timed out.",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send extras (`user`, ...); they are ignored


class StreamOptions(BaseModel):
    include_usage: bool | None = Field(None, description="Send a last chunk with usage.")


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON Schema; absent: any object.")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")


class StructuredOutputs(BaseModel):
    """vLLM's spelling; at most one constraint per request (structured.py)."""

    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="EBNF.")
    json_object: Literal[True] | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls (assistant), tool_call_id (tool)
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None
    name: str | None = None


def _sampling_fields(model: ServedModel, limits: RequestLimits) -> dict[str, Any]:
    """(annotation, Field) per sampling field, bounds from the served model and the settings."""
    ctx, token_id = model.max_model_len, _token_id(model)
    return {
        "n": (int | None, Field(None, ge=1, le=limits.max_n, description="Choices to generate (--max-n).")),
        "max_tokens": (int | None, Field(None, ge=1, lt=ctx, description="Most output tokens; prompt + "
                                         "max_tokens must fit the context and a decode worker's KV cache.")),
        "min_tokens": (int | None, Field(None, ge=0, lt=ctx)),
        "temperature": (float | None, Field(None, ge=0, le=MAX_TEMPERATURE)),
        "top_p": (float | None, Field(None, gt=0, le=1)),
        "top_k": (int | None, Field(None, ge=-1)),
        "min_p": (float | None, Field(None, ge=0, le=1)),
        "seed": (int | None, Field(None, ge=-INT64 - 1, le=INT64)),
        "presence_penalty": (float | None, Field(None, ge=-2, le=2)),
        "frequency_penalty": (float | None, Field(None, ge=-2, le=2)),
        "repetition_penalty": (float | None, Field(None, gt=0)),
        "stop": (str | list[str] | None, Field(None, description="Stop strings (non-empty, at most 4).")),
        "stop_token_ids": (list[token_id] | None, Field(None)),  # type: ignore[valid-type]
        "ignore_eos": (bool | None, None),
        "skip_special_tokens": (bool | None, None),
        "include_stop_str_in_output": (bool | None, None),
        "stream": (bool | None, None),
        "stream_options": (StreamOptions | None, Field(None, description="Only with stream: true.")),
        "return_token_ids": (bool | None, Field(None, description="Tandem: also return token ids.")),
        "prompt_logprobs": (int | None, Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM: logprobs of the "
                                              "prompt tokens, with this many alternatives.")),
        "logit_bias": (dict[str, Annotated[float, Field(ge=-100, le=100)]] | None,
                       Field(None, description="Token id (a string) -> bias added to its logit.")),
        "model": (str | None, Field(None, description=f"The served model ({model.name!r}); may be omitted.")),
        "response_format": (ResponseFormat | None, Field(None, description="OpenAI's output constraint.")),
        "structured_outputs": (StructuredOutputs | None, None),
        "guided_json": (dict[str, Any] | None, None),
        "guided_regex": (str | None, None),
        "guided_choice": (list[str] | None, None),
        "guided_grammar": (str | None, None),
    }


def _token_id(model: ServedModel) -> Any:
    return Annotated[int, Field(ge=0, lt=model.vocab_size)]


def request_models(model: ServedModel, limits: RequestLimits) -> tuple[type[BaseModel], type[BaseModel]]:
    common = _sampling_fields(model, limits)
    token_id = _token_id(model)
    completion = create_model(
        "CompletionRequest", __base__=_Body, **common,
        prompt=(str | list[token_id] | list[str] | list[list[token_id]],  # type: ignore[valid-type]
                Field(description="A string, token ids, or a batch (list, up to 256) of either.")),
        logprobs=(int | None, Field(None, ge=0, le=MAX_LOGPROBS, description="Top alternatives per token.")),
        echo=(bool | None, Field(None, description="Put the prompt (and with logprobs, its logprobs) first; "
                                 "allows max_tokens 0.")),
        suffix=(Literal[""] | None, Field(None, description="Not supported (no fill-in-the-middle): only empty.")),
        best_of=(int | None, Field(None, description="Only equal to n.")),
    )
    chat = create_model(
        "ChatCompletionRequest", __base__=_Body, **common,
        messages=(list[ChatMessage], Field(min_length=1)),
        logprobs=(bool | None, None),
        top_logprobs=(int | None, Field(None, ge=0, le=MAX_LOGPROBS, description="Needs logprobs: true.")),
        max_completion_tokens=(int | None, Field(None, ge=1, lt=model.max_model_len,
                                                 description="Alias of max_tokens.")),
        tools=(list[FunctionTool] | None, Field(None, description="Function tools (docs/openai.md).")),
        tool_choice=(Literal["none", "auto", "required"] | NamedToolChoice | None, None),
        parallel_tool_calls=(bool | None, None),
    )
    return completion, chat


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class FunctionTool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


def openapi_route(schema_name: str) -> dict[str, Any]:
    """The route arguments that point a POST's body at a documented model."""
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"openapi_extra": {
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema_name}"}}}},
        "responses": {status: {"description": text, **error} for status, text in _ERROR_STATUSES.items()},
    }}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(BaseModel):
    error: ErrorDetail


def install_openapi(app: FastAPI, model: ServedModel, limits: RequestLimits) -> None:
    """app.openapi() returns FastAPI's document plus the request and error models."""
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title="Tandem", version="1", routes=app.routes,
                              description="OpenAI-compatible completions and chat completions.")
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            ref = "#/components/schemas/{model}"
            for cls in (*request_models(model, limits), Error):
                schema = cls.model_json_schema(ref_template=ref)
                schemas.update(schema.pop("$defs", {}))
                schemas[cls.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build  # type: ignore[method-assign]
