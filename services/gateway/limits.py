"""The gateway's limits on hostile input, each checked before the work it protects.

    body bytes  > --max-request-body-bytes      -> 413 before the body is read or parsed
    JSON nesting > MAX_JSON_DEPTH               -> 400 before any field is looked at
    a lone surrogate (e.g. "\\ud800") in a string -> 400 naming the field (no tokenizer sees it)
    prompt characters that cannot fit           -> 413 before the prompt is tokenized
    n > --max-n                                 -> 400
    temperature outside [0, 2] (OpenAI's range) -> 400
    a token id the client sends (stop_token_ids) outside the vocabulary -> 400
    a prompt over the roomiest decode worker's whole KV cache (registry) -> 413, and
        prompt + max_tokens over it -> 400: it could never be admitted, so it must not wait in
        the queue; with max_tokens unset, the default shrinks to what fits
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request

from common.sampling.params import SamplingParams
from services.gateway.errors import InvalidRequest, PromptTooLong
from services.gateway.model import ServedModel
from services.gateway.request_types import GenerationRequest

# Deep enough for any real request (a JSON schema in response_format included), far below
# Python's recursion limit, so nothing downstream can hit RecursionError on a body.
MAX_JSON_DEPTH = 128
MAX_TEMPERATURE = 2.0  # OpenAI's documented range is 0..2
# A normalizer can merge characters (NFC composes up to 3 Hangul jamo into one syllable), so a
# token may cover more text than its vocabulary string: the character bound keeps this slack.
CHARS_SLACK = 4


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_request_body_bytes: int = 8 * 2**20
    max_n: int = 128


class BodyTooLarge(PromptTooLong):
    """413 like a too-long prompt, but about the bytes on the wire."""


# --------------------------------------------------------------------------- body

async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (413) once it passes max_bytes: by Content-Length before a
    byte is read, or while streaming a chunked body, so memory stays bounded either way."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(f"{int(declared)} bytes", max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(f"more than {max_bytes} bytes", max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise InvalidRequest("the client closed the connection before the body arrived", param="body") from None
    return b"".join(chunks)


def _too_large(size: str, max_bytes: int) -> BodyTooLarge:
    return BodyTooLarge(f"the request body has {size}; this gateway accepts at most {max_bytes} "
                        "(--max-request-body-bytes)", param="body", code="request_too_large")


def check_json(body: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Depth and string checks over a parsed body, iteratively (no recursion to exhaust).
    A string with a lone surrogate cannot be encoded (tokenizers and protobuf fail on it).
    Only containers and non-ASCII strings are visited: a list of a million token ids is one
    pass of isinstance checks, and a path is spelled out only for an error."""
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(body, 1, ())]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            _check_encodable(value, path)
            continue
        if depth > max_depth:
            raise InvalidRequest(f"the request body nests deeper than {max_depth} levels (at {_spell(path)})",
                                 param=_top(path), code="too_deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not key.isascii():
                _check_encodable(key, (*path, key))
            if isinstance(item, (dict, list)) or (isinstance(item, str) and not item.isascii()):
                stack.append((item, depth + 1, (*path, key)))


def _check_encodable(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(f"{_spell(path)}: a string holds an unpaired surrogate ({text[e.start]!r} at "
                             f"character {e.start}), which is not valid Unicode", param=_top(path),
                             code="invalid_string") from None


def _spell(path: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "the top"


def _top(path: tuple[Any, ...]) -> str:
    """OpenAI's param names the top-level field: 'messages' for messages[0].content."""
    return str(path[0]) if path else "body"


def depth_error() -> InvalidRequest:
    """What a RecursionError while parsing JSON means to the client."""
    return InvalidRequest(f"the request body nests too deeply (at most {MAX_JSON_DEPTH} levels)", param="body",
                          code="too_deep")


# --------------------------------------------------------------------------- prompt length

def check_prompt_chars(texts: Iterable[str], model: ServedModel, param: str) -> None:
    """Rejects text that cannot fit the context whatever its tokens, before tokenizing it:
    no token covers more than model.max_token_chars characters."""
    chars = sum(len(t) for t in texts)
    most = model.max_model_len * model.max_token_chars * CHARS_SLACK
    if chars > most:
        raise PromptTooLong(f"the {param} has {chars} characters: more than {model.max_model_len} tokens of "
                            f"this model can hold (at most {most} characters), so it was not tokenized",
                            param=param, code="context_length_exceeded")


def check_token_count(count: int, model: ServedModel, param: str) -> None:
    """A list of token ids longer than the context, refused before each id is looked at."""
    if count >= model.max_model_len:
        raise PromptTooLong(f"the prompt has {count} tokens, but this model's context is {model.max_model_len} "
                            f"tokens (prompt + at least 1 output token must fit)", param=param,
                            code="context_length_exceeded")


# --------------------------------------------------------------------------- sampling

def check_sampling(params: SamplingParams, model: ServedModel, limits: RequestLimits) -> None:
    """API-level bounds on top of SamplingParams' own checks (the engine accepts wider ranges)."""
    if params.n > limits.max_n:
        raise InvalidRequest(f"n must be <= {limits.max_n} (--max-n), got {params.n}", param="n")
    if params.temperature > MAX_TEMPERATURE:
        raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {params.temperature}",
                             param="temperature")
    for i, t in enumerate(params.stop_token_ids):
        if t >= model.vocab_size:
            raise InvalidRequest(f"stop_token_ids[{i}] = {t} is outside the vocabulary [0, {model.vocab_size})",
                                 param="stop_token_ids")


# --------------------------------------------------------------------------- KV capacity

@dataclass(frozen=True, slots=True)
class KVCapacity:
    """The most tokens one sequence can hold on the roomiest decode worker (whole cache)."""

    max_tokens: int

    @classmethod
    def of(cls, caches: Iterable[tuple[int, int]]) -> KVCapacity | None:
        """caches: (blocks in the whole cache, tokens per block) per decode worker."""
        most = max((blocks * block_size for blocks, block_size in caches), default=0)
        return cls(most) if most > 0 else None


def check_request(req: GenerationRequest, model: ServedModel, limits: RequestLimits,
                  capacity: KVCapacity | None) -> GenerationRequest:
    """Every edge's last check before the orchestrator (REST and gRPC alike)."""
    check_sampling(req.params, model, limits)
    return fit_to_capacity(req, capacity)


def fit_to_capacity(req: GenerationRequest, capacity: KVCapacity | None) -> GenerationRequest:
    """A request that can never be admitted gets 413 now instead of waiting forever; a defaulted
    max_tokens shrinks to fit. Per sequence, as the engine checks: n > 1 siblings share the
    prompt's blocks and may take turns, so each must fit alone."""
    if capacity is None:
        return req  # no worker known yet: routing answers 503
    params, prompt = req.params, len(req.prompt_token_ids)
    room = capacity.max_tokens - prompt  # output tokens that fit beside the prompt
    if room < max(1, params.min_tokens):
        raise PromptTooLong(f"the prompt ({prompt} tokens) does not fit in the KV cache of any decode worker "
                            f"({capacity.max_tokens} tokens at most, prompt + output)", param="prompt",
                            code="kv_capacity_exceeded")
    if params.max_tokens <= room:
        return req
    if not req.max_tokens_defaulted:
        name = req.max_tokens_field
        raise InvalidRequest(f"prompt ({prompt} tokens) + {name} ({params.max_tokens}) exceeds the KV cache of "
                            f"every decode worker ({capacity.max_tokens} tokens at most)", param=name,
                            code="kv_capacity_exceeded")
    return dataclasses.replace(req, params=dataclasses.replace(params, max_tokens=room))
