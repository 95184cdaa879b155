from __future__ import annotations

import dataclasses

import pytest

from common.sampling.params import SamplingParams, SamplingParamsError


def test_defaults_are_valid_and_containers_normalised() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[7, 9])
    assert p.stop == ("###",)
    assert p.stop_token_ids == (7, 9)
    assert p.n == 1 and p.temperature == 1.0 and p.top_k == -1 and p.skip_special_tokens
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"n": 0}, "n", "0"),
        ({"n": True}, "n", "True"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "5"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"temperature": "1"}, "temperature", "'1'"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 2.5}, "top_k", "2.5"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"seed": 1.0}, "seed", "1.0"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"stop": [""]}, "stop", "''"),
        ({"stop": ["ok", 3]}, "stop", "3"),
        ({"stop": 5}, "stop", "5"),
        ({"stop_token_ids": [1, -4]}, "stop_token_ids", "-4"),
        ({"stop_token_ids": "12"}, "stop_token_ids", "'12'"),
        ({"ignore_eos": 1}, "ignore_eos", "1"),
        ({"logprobs": 21}, "logprobs", "21"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"skip_special_tokens": None}, "skip_special_tokens", "None"),
    ],
)
def test_validation_names_field_and_value(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
    assert field in str(exc.value) and shown in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_boundaries_accepted() -> None:
    SamplingParams(
        temperature=0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2.0,
        logprobs=20,
        max_tokens=None,
        min_tokens=3,
        seed=2**63 - 1,
    )
    SamplingParams(max_tokens=3, min_tokens=3, logprobs=0, seed=-(2**63))


def test_seed_is_int64() -> None:
    # The wire type is int64: 2**63 could never be sent to a worker (it gave a 500 after Reserve).
    for seed in (2**63, -(2**63) - 1, 2**64 - 1):
        with pytest.raises(SamplingParamsError, match="seed"):
            SamplingParams(seed=seed)


def test_replace_revalidates() -> None:
    p = SamplingParams(max_tokens=10)
    with pytest.raises(SamplingParamsError, match="max_tokens"):
        dataclasses.replace(p, max_tokens=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n = 2  # type: ignore[misc]


def test_from_dict_openai_names() -> None:
    p = SamplingParams.from_dict(
        {
            "n": 2,
            "max_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 1234,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repetition_penalty": 1.1,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [2],
            "ignore_eos": False,
            "logprobs": 5,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "min_tokens": 1,
        }
    )
    assert p.stop == ("\n\n", "END") and p.logprobs == 5 and p.top_k == 40 and not p.skip_special_tokens


def test_from_dict_nulls_and_chat_forms() -> None:
    p = SamplingParams.from_dict({"temperature": None, "seed": None, "stop": None, "max_tokens": None})
    assert p == dataclasses.replace(SamplingParams(), max_tokens=16)
    chat = SamplingParams.from_dict({"logprobs": True, "top_logprobs": 3, "max_completion_tokens": 8})
    assert chat.logprobs == 3 and chat.max_tokens == 8
    assert SamplingParams.from_dict({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_dict({"logprobs": False}).logprobs is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"temprature": 0.5}, "temprature"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stop_token_ids": "1,2"}, "stop_token_ids"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "logprobs"),
        ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
        ({"n": [1]}, "n"),
    ],
)
def test_from_dict_rejects_with_field(body: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError) as exc:
        SamplingParams.from_dict(body)
    assert exc.value.field == field
