"""OpenAI request bodies -> GenerationRequest, and GenerationUpdates -> OpenAI response bodies.

Validation names the offending field in `param` (InvalidRequest -> 400); sampling ranges are
SamplingParams' own checks (SamplingParamsError names the field). Context-length rules:
    len(prompt) >= max_model_len                 -> 413 param "prompt" / "messages"
    len(prompt) + max_tokens > max_model_len     -> 400 param "max_tokens"
    max_tokens unset: completions 16 (capped to the room left), chat: all the room left
Unknown top-level fields are ignored (clients send extras such as `user`); fields we cannot honour
(`suffix`: no fill-in-the-middle, `best_of` != n, `echo` on chat) are rejected by name.

Completions take a batch of prompts (strings or token-id lists): each prompt is its own cluster
request, and choice i*n + c is choice c of prompt i, as OpenAI indexes them. `echo` puts the prompt
in front of each choice's text; with `logprobs` it also reports the prompt tokens' logprobs (the
first one null), computed by the engine over the prompt positions (`prompt_logprobs`), which is
what lm-evaluation-harness's loglikelihood reads; `max_tokens: 0` is allowed with echo (the prompt
alone is scored).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from common.sampling.params import SamplingParams, SamplingParamsError
from services.gateway import limits
from services.gateway.completion_batch import echo_params, echo_texts
from services.gateway.errors import InvalidRequest, MalformedBody, NotFound, PromptTooLong
from services.gateway.model import ServedModel
from services.gateway.request_types import (ChoiceResult, ChoiceUpdate, GenerationRequest, TokenLogprob,
                                            Usage)
from services.gateway.structured import grammar_from_body
from services.gateway.tool_calls import constrain_tool_calls, history_message, parse_tools

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_SEQUENCES = 4  # OpenAI's limit on `stop`
_COMMON_SAMPLING = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "logit_bias",
)  # fmt: skip
COMPLETION_SAMPLING = (*_COMMON_SAMPLING, "logprobs")
CHAT_SAMPLING = (*_COMMON_SAMPLING, "logprobs", "top_logprobs", "max_completion_tokens")
# OpenAI's roles (function: its deprecated name of tool); anything else is a client bug.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass(slots=True)
class ApiRequest:
    """A parsed REST request: the domain request(s) plus how to shape the answer."""

    generations: list[GenerationRequest]  # one per prompt (completions take a batch)
    kind: str  # "completion" | "chat"
    stream: bool
    include_usage: bool
    response_id: str
    created: int
    echo: bool = False
    prompt_texts: list[str] = field(default_factory=list)  # per prompt, for echo
    scoring_only: bool = False  # max_tokens 0 with echo: the one generated token is dropped
    tools: Any = None  # chat: the parsed tools request (services/gateway/tool_calls.py), if any

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]

    @property
    def n(self) -> int:
        return self.generation.params.n

    @property
    def num_choices(self) -> int:
        return self.n * len(self.generations)


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


def bool_field(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
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
    return bool_field(options, "include_usage")


def _reject_unsupported(body: Mapping[str, Any], model: ServedModel) -> None:
    if body.get("suffix") not in (None, ""):
        raise InvalidRequest(f"suffix needs a fill-in-the-middle model; {model.name!r} has none", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise InvalidRequest("best_of other than n is not supported (every generated choice is returned; "
                             "rank them client-side with logprobs)", param="best_of")
    stop = body.get("stop")
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}", param="stop")


def _sampling(body: Mapping[str, Any], names: Sequence[str], model: ServedModel) -> SamplingParams:
    fields = {k: body[k] for k in names if k in body}
    fields["grammar"] = grammar_from_body(body)  # response_format / structured_outputs / guided_*
    try:
        params = SamplingParams.from_dict(fields)
    except SamplingParamsError as e:
        raise InvalidRequest(str(e), param=e.field) from None
    except TypeError as e:  # a value of a type the dataclass cannot even hold
        raise InvalidRequest(str(e), param="body") from None
    check_logit_bias(params, model)
    return params


def check_logit_bias(params: SamplingParams, model: ServedModel) -> None:
    bad = [t for t, _ in params.logit_bias if t >= model.vocab_size]
    if bad:
        raise InvalidRequest(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {model.vocab_size})",
                             param="logit_bias")


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


def check_token_ids(value: Any, model: ServedModel, param: str) -> list[int]:
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequest(f"{param}[{i}] must be a token id (int), got {t!r}", param=param)
        if not 0 <= t < model.vocab_size:
            raise InvalidRequest(f"{param}[{i}] = {t} is outside the vocabulary [0, {model.vocab_size})",
                                 param=param)
    return list(value)


MAX_BATCH_PROMPTS = 256  # prompts in one completions request (each is its own cluster request)


def completion_prompts(prompt: Any, model: ServedModel) -> list[list[int]]:
    """prompt: a string, a list of token ids, or a batch (list) of either -> token ids per prompt."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_BATCH_PROMPTS:
            raise InvalidRequest(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(prompt)}",
                                 param="prompt")
        return [completion_prompt_ids(p, model, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [completion_prompt_ids(prompt, model)]


def completion_prompt_ids(prompt: Any, model: ServedModel, where: str = "prompt") -> list[int]:
    """One prompt: a string or a list of token ids. `where` names it in errors (prompt[3])."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(f"{where} must not be empty", param="prompt")
        limits.check_prompt_chars([prompt], model, "prompt")
        ids = model.tokenize(prompt)
    elif isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest(f"{where} must be a string or a list of token ids", param="prompt")
    elif isinstance(prompt, list):
        limits.check_token_count(len(prompt), model, "prompt")
        ids = check_token_ids(prompt, model, "prompt")
    elif prompt is None:
        raise InvalidRequest("prompt is required", param="prompt")
    else:
        raise InvalidRequest(f"{where} must be a string or a list of token ids, got {type(prompt).__name__}",
                             param="prompt")
    if not ids:
        raise InvalidRequest(f"{where} must not be empty", param="prompt")
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
            content = ""  # e.g. an assistant message that only carries tool_calls
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        message = {"role": role, "content": content, **history_message(m, i)}
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def parse_completion(body: Mapping[str, Any], model: ServedModel) -> ApiRequest:
    check_model(body, model)
    _reject_unsupported(body, model)
    if isinstance(body.get("logprobs"), bool):
        raise InvalidRequest("logprobs must be an int (how many top alternatives) for completions",
                             param="logprobs")
    echo = bool_field(body, "echo")
    scoring_only = echo and body.get("max_tokens") == 0
    if scoring_only:  # the engine generates >= 1 token; this one is dropped from the answer
        body = {**body, "max_tokens": 1}
    params = echo_params(_sampling(body, COMPLETION_SAMPLING, model), echo)
    prompts = completion_prompts(body.get("prompt"), model)
    per_prompt = [resolve_max_tokens(params, body, len(ids), model, "prompt", COMPLETIONS_DEFAULT_MAX_TOKENS)
                  for ids in prompts]
    api = _api_request(body, model, prompts, per_prompt, "completion", "cmpl")
    api.echo, api.scoring_only = echo, scoring_only
    if echo:
        api.prompt_texts = echo_texts(_as_batch(body.get("prompt")), prompts, model)
    return api


def _as_batch(prompt: Any) -> list[Any]:
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


def parse_chat(body: Mapping[str, Any], model: ServedModel) -> ApiRequest:
    check_model(body, model)
    _reject_unsupported(body, model)
    if body.get("echo"):
        raise InvalidRequest("echo is only supported on /v1/completions", param="echo")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean for chat (use top_logprobs for how many), got "
                             f"{logprobs!r}", param="logprobs")
    params = _sampling(body, CHAT_SAMPLING, model)
    tools = parse_tools(body, model.tool_call_parser, getattr(model.tokenizer, "chat_template", None))
    messages = chat_messages(body.get("messages"))
    limits.check_prompt_chars((m["content"] for m in messages), model, "messages")
    ids = tools.render(model, messages) if tools is not None else model.tokenize_chat(messages)
    if not ids:
        raise InvalidRequest("the rendered chat prompt is empty", param="messages")
    params = constrain_tool_calls(params, tools)  # required / named: the grammar makes it a valid call
    params = resolve_max_tokens(params, body, len(ids), model, "messages", None)
    api = _api_request(body, model, [ids], [params], "chat", "chatcmpl")
    api.tools = tools
    return api



def _api_request(body: Mapping[str, Any], model: ServedModel, prompts: list[list[int]],
                 params: list[SamplingParams], kind: str, prefix: str) -> ApiRequest:
    stream = bool_field(body, "stream")
    include_usage = _stream_options(body, stream)
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    return_ids = bool_field(body, "return_token_ids")
    generations = [
        GenerationRequest(
            request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}", model=model.name,
            prompt_token_ids=ids, params=p, return_token_ids=return_ids,
            max_tokens_defaulted=body.get("max_tokens") is None and body.get("max_completion_tokens") is None,
            max_tokens_field="max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens",
        )
        for i, (ids, p) in enumerate(zip(prompts, params))
    ]
    return ApiRequest(generations, kind, stream, include_usage, request_id, int(time.time()))


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
        # An echoed first prompt token has no logprob, and so no alternatives either (null).
        "top_logprobs": [None if lp.logprob is None else {t.token: t.logprob for t in lp.top_logprobs}
                         for lp in logprobs],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(logprobs: list[TokenLogprob] | None) -> list[Any] | None:
    """vLLM's `prompt_logprobs` shape: null for the first token, then per position a map of token id
    -> {logprob, rank, decoded_token} holding the prompt token and the top alternatives. rank is
    known for tokens among the alternatives (their place, from 1), null otherwise."""
    if logprobs is None:
        return None
    out: list[Any] = [None]
    for lp in logprobs:
        ranks = {t.token_id: r for r, t in enumerate(lp.top_logprobs, start=1)}
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": ranks[t.token_id], "decoded_token": t.token}
                 for t in lp.top_logprobs}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": ranks.get(lp.token_id), "decoded_token": lp.token}
        out.append(entry)
    return out


def api_stop_reason(params: SamplingParams, stop_reason: int | str | None) -> int | str | None:
    """vLLM's convention: the stop string or a stop_token_ids entry that matched; null on a natural
    end (EOS), which the workers report as the EOS id."""
    if isinstance(stop_reason, int) and stop_reason not in params.stop_token_ids:
        return None
    return stop_reason


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


def full_response(api: ApiRequest, model: ServedModel, results: list[ChoiceResult], usage: Usage,
                  prompt_logprobs: Sequence[list[TokenLogprob] | None] = ()) -> dict[str, Any]:
    """results: every choice, indexed across the batch's prompts; prompt_logprobs: per prompt."""
    choices = []
    params = api.generation.params
    for r in results:
        gen = api.generations[r.index // api.n]
        stop_reason = api_stop_reason(gen.params, r.stop_reason)
        if api.kind == "completion":
            choice = {"index": r.index, "text": r.text, "logprobs": completion_logprobs(r.logprobs),
                      "finish_reason": r.finish_reason, "stop_reason": stop_reason}
            if params.prompt_logprobs is not None and prompt_logprobs:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs[r.index // api.n])
        else:
            message = {"role": "assistant", "content": r.text}
            finish = r.finish_reason
            if api.tools is not None:
                message, finish = api.tools.message(r.text, finish)
            choice = {"index": r.index, "message": message, "logprobs": chat_logprobs(r.logprobs),
                      "finish_reason": finish, "stop_reason": stop_reason}
        if api.generation.return_token_ids:
            choice["token_ids"] = r.token_ids
            if len(api.generations) > 1:
                choice["prompt_token_ids"] = gen.prompt_token_ids
        choices.append(choice)
    out = {**_head(api, model, chunk=False), "choices": choices, "usage": usage_dict(usage)}
    if api.kind == "chat" and params.prompt_logprobs is not None and prompt_logprobs:
        out["prompt_logprobs"] = vllm_prompt_logprobs(prompt_logprobs[0])
    if api.generation.return_token_ids and len(api.generations) == 1:
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
                text, finish = c.text, c.finish_reason
                if self.api.tools is not None:
                    text, calls, finish = self.api.tools.delta(c.index, text, finish)
                    if calls:
                        delta["tool_calls"] = calls
                if text or (finish is None and "tool_calls" not in delta):
                    delta["content"] = text
                choice = {"index": c.index, "delta": delta, "logprobs": chat_logprobs(c.logprobs),
                          "finish_reason": finish}
            if c.finish_reason is not None:
                choice["stop_reason"] = api_stop_reason(self.api.generations[c.index // self.api.n].params,
                                                        c.stop_reason)
            if self.api.generation.return_token_ids:
                choice["token_ids"] = c.token_ids
            obj = {**_head(self.api, self.model, chunk=True), "choices": [choice]}
            if self.first and self.api.generation.return_token_ids and len(self.api.generations) == 1:
                obj["prompt_token_ids"] = self.api.generation.prompt_token_ids
            self.first = False
            if self.api.include_usage:
                obj["usage"] = None
            out.append(self._event(obj))
        return "".join(out)

    def prompt_logprobs(self, prompt_index: int, logprobs: list[TokenLogprob]) -> str:
        """vLLM's prompt_logprobs extension while streaming: one chunk when they arrive (with the
        first token, or after it when prefill reports them last); completions put them on the
        prompt's first choice, chat beside the choices."""
        if self.api.generations[prompt_index].params.prompt_logprobs is None or self.api.echo:
            return ""  # echo already put them in the choices' logprobs
        entries = vllm_prompt_logprobs(logprobs)
        head = _head(self.api, self.model, chunk=True)
        if self.api.kind == "chat":
            return self._event({**head, "choices": [], "prompt_logprobs": entries})
        choice = {"index": prompt_index * self.api.n, "text": "", "logprobs": None, "finish_reason": None,
                  "prompt_logprobs": entries}
        return self._event({**head, "choices": [choice]})

    def finish(self, usage: Usage | None) -> str:
        out = ""
        if self.api.include_usage and usage is not None:
            out = self._event({**_head(self.api, self.model, chunk=True), "choices": [],
                               "usage": usage_dict(usage)})
        return out + "data: [DONE]\n\n"

    def error(self, error: dict[str, Any]) -> str:
        # No [DONE] after an error: [DONE] tells the client the answer is complete, and it is not.
        return self._event(error)
