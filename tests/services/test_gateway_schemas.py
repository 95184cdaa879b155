"""Pure validation of OpenAI bodies: each bad field -> the documented error naming it."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import InvalidRequest, MalformedBody, NotFound, PromptTooLong
from services.gateway.openai_schemas import (ChunkWriter, full_response, parse_chat, parse_completion,
                                             parse_json_body)
from services.gateway.request_types import ChoiceResult, ChoiceUpdate, Usage
from tests.services.gateway_helpers import MODEL_NAME, served_model


@pytest.fixture(scope="module")
def model(tiny_model):
    return served_model(tiny_model)


def _err(fn, *args):
    with pytest.raises(InvalidRequest) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 2.0), ("seed", "x"), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0), ("n", 0), ("n", True), ("max_tokens", 0), ("max_tokens", -5),
    ("logprobs", 21), ("logprobs", True), ("stop", 5), ("stop", [""]), ("stop_token_ids", [-1]),
    ("ignore_eos", "yes"), ("min_tokens", -1), ("stream", "yes"),
])
def test_bad_completion_field_is_named(model, field, value):
    e = _err(parse_completion, {"model": MODEL_NAME, "prompt": "hello", field: value}, model)
    assert e.http_status == 400 and e.param == field, e.message


@pytest.mark.parametrize("body,param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({}, "prompt"), ({"prompt": 7}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"), ({"prompt": [1, 99999]}, "prompt"), ({"prompt": [1, "x"]}, "prompt"),
    ({"prompt": "hi", "echo": 1}, "echo"), ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "stop": list("abcde")}, "stop"), ({"prompt": "hi", "logit_bias": {"1024": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"), ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "best_of": 3}, "best_of"), ({"prompt": "hi", "stream_options": {"include_usage": True}},
                                                    "stream_options"),
    ({"prompt": "hi", "model": 5}, "model"), ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
])
def test_bad_completion_body(model, body, param):
    e = _err(parse_completion, body, model)
    assert e.http_status == 400 and e.param == param, e.message


def test_unknown_model_is_404(model):
    with pytest.raises(NotFound) as info:
        parse_completion({"model": "gpt-9", "prompt": "hi"}, model)
    assert info.value.http_status == 404 and info.value.param == "model"


def test_prompt_too_long_is_413(model):
    with pytest.raises(PromptTooLong) as info:
        parse_completion({"prompt": [5] * model.max_model_len}, model)
    assert info.value.http_status == 413 and info.value.param == "prompt"
    with pytest.raises(PromptTooLong) as info:
        parse_chat({"messages": [{"role": "user", "content": "word " * model.max_model_len}]}, model)
    assert info.value.param == "messages"


@pytest.mark.parametrize("raw,status", [(b"{not json", 422), (b"\xff\xfe\x00bad", 422), (b"[1, 2]", 400),
                                        (b"", 422)])
def test_malformed_body(raw, status):
    with pytest.raises(InvalidRequest) as info:
        parse_json_body(raw)
    assert info.value.http_status == status and info.value.param == "body"
    assert isinstance(info.value, MalformedBody) == (status == 422)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"), ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9000}, "max_completion_tokens"),
])
def test_bad_chat_body(model, body, param):
    e = _err(parse_chat, body, model)
    assert e.param == param, e.message


def test_defaults_and_resolution(model):
    api = parse_completion({"model": MODEL_NAME, "prompt": [1, 2, 3]}, model)
    assert api.generation.params.max_tokens == 16 and api.generation.prompt_token_ids == [1, 2, 3]
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                       "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 7}, model)
    assert chat.generation.params.logprobs == 2 and chat.generation.params.max_tokens == 7
    unlimited = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, model)
    assert unlimited.generation.params.max_tokens == model.max_model_len - len(unlimited.generation.prompt_token_ids)
    batch_of_one = parse_completion({"prompt": ["hello"], "stream": True,
                                     "stream_options": {"include_usage": True}}, model)
    assert batch_of_one.generation.prompt_token_ids == model.tokenize("hello") and batch_of_one.include_usage


def test_response_shapes(model):
    api = parse_chat({"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True, "stream": True,
                      "stream_options": {"include_usage": True}}, model)
    writer = ChunkWriter(api, model)
    text = writer.update([ChoiceUpdate(0, [5, 6], "ab", None)]) + writer.update(
        [ChoiceUpdate(0, [7], "c", None, "stop", 2)]) + writer.finish(Usage(4, 3, 0))
    events = [e[len("data: "):] for e in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "ab"}
    assert chunks[0]["prompt_token_ids"] == api.generation.prompt_token_ids
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[1]["usage"] is None
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["total_tokens"] == 7
    full = full_response(api, model, [ChoiceResult(0, "abc", [5, 6, 7], None, "length")], Usage(4, 3, 2))
    assert full["choices"][0]["message"]["content"] == "abc" and full["choices"][0]["token_ids"] == [5, 6, 7]
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
