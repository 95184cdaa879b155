"""Completions and chat details through a real disaggregated cluster, with the official client:
batches of prompts, echo, prompt logprobs (equal to transformers'), logit_bias, stop_reason,
content parts, n with seed, /tokenize, /detokenize, GET /v1/models/{id}, and clear 400s."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from tests.cluster.cluster_helpers import gateway_channel
from tests.engine.engine_helpers import _hf_model

PROMPT = [5, 77, 301, 12, 640, 9, 18, 255, 1000, 3, 44, 101, 7, 88, 512, 33, 21, 600, 2]  # 19 tokens: 2 chunks


def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(str(model))(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)  # [P-1, V]


def test_batch_of_prompts_indexes_choices_across_prompts(client, model_id):
    prompts = [[5, 6, 7, 8], [100, 200, 300], [9, 10]]
    batch = client.completions.create(model=model_id, prompt=prompts, n=2, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert [c.index for c in batch.choices] == list(range(6))
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
        for c in batch.choices[2 * i: 2 * i + 2]:
            assert c.token_ids == alone.choices[0].token_ids
    assert batch.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert batch.usage.completion_tokens == 6 * 4
    texts = client.completions.create(model=model_id, prompt=["Hello there", "A B C"], max_tokens=2)
    assert [c.index for c in texts.choices] == [0, 1]


def test_batch_streams_every_choice(client, model_id):
    chunks = list(client.completions.create(model=model_id, prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    finished = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert finished == {0: "length", 1: "length"}


@pytest.mark.parametrize("n", [1, 2])  # 1: prefill computes the prompt; 2: decode does (LOCAL)
@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_transformers(client, model_id, tiny_model, n, max_tokens):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0 or 1."""
    reply = client.completions.create(model=model_id, prompt=PROMPT, echo=True, logprobs=1, max_tokens=max_tokens,
                                      temperature=0, n=n)  # fmt: skip
    ref = hf_prompt_logprobs(tiny_model, PROMPT)
    for choice in reply.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(PROMPT) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for pos in range(1, len(PROMPT)):
            assert math.isclose(lp.token_logprobs[pos], ref[pos - 1, PROMPT[pos]].item(), abs_tol=1e-4), pos
            (top_token, top_lp), = lp.top_logprobs[pos].items()
            assert math.isclose(top_lp, ref[pos - 1].max().item(), abs_tol=1e-4)
        assert lp.text_offset[0] == 0 and choice.text.startswith(lp.tokens[0])
    assert reply.usage.completion_tokens == n * max_tokens
    if max_tokens == 0:
        assert all(c.finish_reason == "length" for c in reply.choices)


def test_echo_without_logprobs_prefixes_the_prompt(client, model_id):
    reply = client.completions.create(model=model_id, prompt="Once upon", echo=True, max_tokens=3)
    assert reply.choices[0].text.startswith("Once upon")
    chunks = list(client.completions.create(model=model_id, prompt="Once upon", echo=True, max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith("Once upon")


def test_prompt_logprobs_extension_on_both_endpoints(client, model_id, tiny_model, http):
    ref = hf_prompt_logprobs(tiny_model, PROMPT)
    body = {"model": model_id, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    reply = http.post("/v1/completions", json=body, timeout=120).json()
    plp = reply["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = plp[pos][str(PROMPT[pos])]
        assert math.isclose(entry["logprob"], ref[pos - 1, PROMPT[pos]].item(), abs_tol=1e-4)
        assert 2 <= len(plp[pos]) <= 3
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [c["prompt_logprobs"] for e in events for c in e["choices"] if c.get("prompt_logprobs")]
    assert streamed == [plp]
    chat = http.post("/v1/chat/completions", timeout=120, json={
        "model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0,
    }).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
    chat_body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                 "prompt_logprobs": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=chat_body, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [e["prompt_logprobs"] for e in events if "prompt_logprobs" in e] == [chat["prompt_logprobs"]]


def test_logit_bias_in_the_sampler_and_stop_reason(client, model_id, http):
    forced = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=5, temperature=0.8, seed=1,
                                       logit_bias={"321": 100}, extra_body={"ignore_eos": True,
                                                                            "return_token_ids": True})
    assert forced.choices[0].token_ids == [321] * 5
    eos = http.post("/tokenize", json={"prompt": "x", "return_token_strs": True}).json()
    del eos
    # A natural end (EOS, forced here through logit_bias on the EOS id): stop_reason is null.
    tok = _hf_tokenizer(client)
    ended = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=5,
                                      logit_bias={str(tok.eos_token_id): 100})
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].model_extra["stop_reason"] is None
    by_id = client.completions.create(model=model_id, prompt=[5, 6, 7], max_tokens=5, logit_bias={"321": 100},
                                      extra_body={"stop_token_ids": [321]})
    assert by_id.choices[0].finish_reason == "stop" and by_id.choices[0].model_extra["stop_reason"] == 321


def _hf_tokenizer(client):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_model_path[0])


_model_path: list[str] = []


@pytest.fixture(autouse=True)
def _remember_model(tiny_model):
    _model_path[:] = [str(tiny_model)]


def test_chat_details(client, model_id):
    parts = client.chat.completions.create(model=model_id, max_completion_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                                                  {"type": "text", "text": "there"}]}])
    plain = client.chat.completions.create(model=model_id, max_completion_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "Hi there"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens <= 3
    a, b = (client.chat.completions.create(model=model_id, n=2, seed=42, max_tokens=6, temperature=1.0,
                                           messages=[{"role": "user", "content": "Tell"}]) for _ in range(2))
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len(a.choices) == 2


def test_tokenize_detokenize_and_model_retrieve(client, model_id, http):
    tok = http.post("/tokenize", json={"model": model_id, "prompt": "Hello world",
                                                   "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] > 0
    back = http.post("/detokenize", json={"model": model_id, "tokens": tok["tokens"]}).json()
    assert "Hello world" in back["prompt"]
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 1
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


@pytest.mark.parametrize("extra,param", [
    ({"suffix": "tail"}, "suffix"), ({"best_of": 3}, "best_of"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"prompt": [[1, 2], "x", ""]}, "prompt"), ({"max_tokens": 0}, "max_tokens"),
])  # fmt: skip
def test_clear_400s(http, model_id, extra, param):
    body = {"model": model_id, "prompt": "hi", "max_tokens": 2, **extra}
    r = http.post("/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_rejects_non_text_parts(http, model_id):
    r = http.post("/v1/chat/completions", timeout=60, json={
        "model": model_id, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert "text" in r.json()["error"]["message"]


def test_detokenize_bad_ids(http):
    r = http.post("/detokenize", json={"tokens": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_same_fields_over_grpc(disagg, tiny_model):
    import grpc

    from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    ref = hf_prompt_logprobs(tiny_model, PROMPT)
    with gateway_channel(disagg) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1, logit_bias={321: 100.0},
                                             ignore_eos=True)
        reply = stub.Complete(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                                             sampling=sampling, return_token_ids=True), timeout=120)
        assert list(reply.choices[0].token_ids) == [321] * 3
        assert len(reply.prompt_logprobs) == len(PROMPT) - 1
        assert math.isclose(reply.prompt_logprobs[3].logprob, ref[3, PROMPT[4]].item(), abs_tol=1e-4)
        assert reply.prompt_logprobs[3].token and len(reply.prompt_logprobs[3].top_logprobs) == 1
        streamed = list(stub.Generate(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                                                     sampling=sampling), timeout=120))
        assert sum(len(m.prompt_logprobs) for m in streamed) == len(PROMPT) - 1
        text = stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[5, 6, 7]), timeout=30).text
        assert isinstance(text, str) and text
        with pytest.raises(grpc.RpcError) as info:
            stub.Complete(generation_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
                logit_bias={10**6: 1.0})), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias" in info.value.details()
