"""gRPC tandem.v1.Generation: prompt batches and echo (with logprobs: prompt logprobs), through the
real disaggregated cluster of this folder, against the REST path's answers."""

from __future__ import annotations

import math
import threading

import grpc
import pytest

from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster.cluster_helpers import gateway_channel
from tests.openai.test_completions_details import PROMPT

Batch, BatchPrompt, TokenIds = generation_pb2.PromptBatch, generation_pb2.BatchPrompt, generation_pb2.TokenIds


@pytest.fixture(scope="module")
def stub(disagg):
    with gateway_channel(disagg) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def ids_batch(*prompts: list[int]) -> generation_pb2.PromptBatch:
    return Batch(prompts=[BatchPrompt(token_ids=TokenIds(ids=p)) for p in prompts])


def test_batch_of_two_prompts_n2_indexes_four_choices(stub):
    prompts = [[5, 6, 7, 8], [100, 200, 300]]
    reply = stub.Complete(generation_pb2.GenerateRequest(
        request_id="b2n2", batch=ids_batch(*prompts), sampling=greedy(4, n=2), return_token_ids=True), timeout=120)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):  # choice i * n + c is choice c of prompt i
        alone = stub.Complete(generation_pb2.GenerateRequest(
            token_ids=TokenIds(ids=prompt), sampling=greedy(4), return_token_ids=True), timeout=120)
        for c in reply.choices[2 * i: 2 * i + 2]:
            assert list(c.token_ids) == list(alone.choices[0].token_ids)
        assert list(reply.prompts[i].prompt_token_ids) == prompt
    assert reply.usage.prompt_tokens == 7 and reply.usage.completion_tokens == 4 * 4
    assert list(reply.prompt_token_ids) == prompts[0]

    streamed = list(stub.Generate(generation_pb2.GenerateRequest(
        batch=ids_batch(*prompts), sampling=greedy(4, n=2), return_token_ids=True), timeout=120))
    tokens: dict[int, list[int]] = {}
    for m in streamed:
        for c in m.choices:
            assert c.index // 2 == m.prompt_index
            tokens.setdefault(c.index, []).extend(c.token_ids)
    assert tokens == {c.index: list(c.token_ids) for c in reply.choices}
    assert [m.HasField("usage") for m in streamed].count(True) == 1 and streamed[-1].usage.completion_tokens == 16
    firsts = {m.prompt_index: list(m.prompt_token_ids) for m in streamed if m.prompt_token_ids}
    assert firsts == {0: prompts[0], 1: prompts[1]}

    texts = stub.Complete(generation_pb2.GenerateRequest(batch=Batch(prompts=[
        BatchPrompt(text="Hello there"), BatchPrompt(text="A B C")]), sampling=greedy(2)), timeout=120)
    assert [c.index for c in texts.choices] == [0, 1]


def test_echo_puts_the_prompt_first(stub, disagg):
    reply = stub.Complete(generation_pb2.GenerateRequest(text="Once upon", echo=True, sampling=greedy(3)),
                          timeout=120)
    assert reply.choices[0].text.startswith("Once upon") and len(reply.choices[0].text) > len("Once upon")
    streamed = list(stub.Generate(generation_pb2.GenerateRequest(text="Once upon", echo=True, sampling=greedy(3)),
                                  timeout=120))
    assert "".join(c.text for m in streamed for c in m.choices) == reply.choices[0].text

    # Token ids and logprobs: the prompt's tokens come first, the first with no logprob.
    with_lp = stub.Complete(generation_pb2.GenerateRequest(
        token_ids=TokenIds(ids=PROMPT), echo=True, sampling=greedy(2, logprobs=1)), timeout=120)
    lps = with_lp.choices[0].logprobs
    assert [lp.token_id for lp in lps[:len(PROMPT)]] == PROMPT and len(lps) == len(PROMPT) + 2
    assert lps[0].no_logprob and not lps[0].top_logprobs
    assert not any(lp.no_logprob for lp in lps[1:]) and all(len(lp.top_logprobs) == 1 for lp in lps[1:])


@pytest.mark.parametrize("n", [1, 2])  # 1: prefill computes the prompt; 2: decode does (LOCAL)
def test_echo_logprobs_equal_the_rest_path(stub, http, model_id, n):
    """lm-evaluation-harness's loglikelihood request over gRPC: echo, logprobs 1, max_tokens 0."""
    prompts = [PROMPT, PROMPT[3:15]]
    rest = http.post("/v1/completions", json={
        "model": model_id, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "n": n,
        "temperature": 0}, timeout=120).json()  # fmt: skip
    reply = stub.Complete(generation_pb2.GenerateRequest(
        batch=ids_batch(*prompts), echo=True, sampling=greedy(0, logprobs=1, n=n)), timeout=120)
    assert len(reply.choices) == len(rest["choices"]) == 2 * n
    for choice, want in zip(reply.choices, rest["choices"]):
        got = want["logprobs"]
        assert choice.text == want["text"] and choice.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert [lp.token for lp in choice.logprobs] == got["tokens"]
        assert choice.logprobs[0].no_logprob and got["token_logprobs"][0] is None
        for lp, ref, top in zip(choice.logprobs[1:], got["token_logprobs"][1:], got["top_logprobs"][1:]):
            assert math.isclose(lp.logprob, ref, abs_tol=1e-6)
            assert {t.token: t.logprob for t in lp.top_logprobs} == pytest.approx(top, abs=1e-6)
    assert reply.usage.completion_tokens == 0 == rest["usage"]["completion_tokens"]
    assert [len(p.prompt_logprobs) for p in reply.prompts] == [len(p) - 1 for p in prompts]


def test_abort_by_request_id_stops_the_whole_batch(stub):
    request = generation_pb2.GenerateRequest(request_id="batch-to-abort", batch=ids_batch([5, 6, 7], [8, 9, 10]),
                                             sampling=greedy(3000))
    finishes: dict[int, int] = {}
    started = threading.Event()

    def consume() -> None:
        for m in stub.Generate(request, timeout=120):
            started.set()
            for c in m.choices:
                if c.finish_reason:
                    finishes[c.index] = c.finish_reason

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(120)
    assert stub.Abort(common_pb2.AbortRequest(request_id="batch-to-abort"), timeout=30).aborted
    reader.join(120)
    assert finishes == {0: common_pb2.FINISH_REASON_ABORT, 1: common_pb2.FINISH_REASON_ABORT}


@pytest.mark.parametrize("request_kw, field", [
    ({"chat": generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")]),
      "echo": True}, "echo"),
    ({"batch": Batch()}, "prompt"),
    ({"batch": Batch(prompts=[BatchPrompt(text="ok"), BatchPrompt(token_ids=TokenIds(ids=[1, 10**7]))])}, "prompt"),
    ({"batch": Batch(prompts=[BatchPrompt(text="ok"), BatchPrompt()])}, "prompt[1]"),
])  # fmt: skip
def test_bad_batches_are_invalid_argument_by_name(stub, request_kw, field):
    with pytest.raises(grpc.RpcError) as info:
        stub.Complete(generation_pb2.GenerateRequest(sampling=greedy(2), **request_kw), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()
