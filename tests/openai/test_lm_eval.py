"""Acceptance 3: lm-evaluation-harness (local-completions) against a real disaggregated cluster: one
generate_until and one multiple_choice task, each of 10 items written here, run with no error, and
every loglikelihood the cluster answered equals transformers' (float32) to 1e-4."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.cluster.cluster_helpers import api_key
from tests.engine.engine_helpers import _hf_model

pytest.importorskip("lm_eval")  # a test dependency (pyproject [test]); make test installs it

ITEMS = [("red", "apple"), ("yellow", "banana"), ("green", "lime"), ("purple", "grape"), ("orange", "orange"),
         ("brown", "kiwi"), ("pink", "peach"), ("black", "olive"), ("white", "coconut"), ("blue", "blueberry")]


def _write_tasks(folder) -> None:
    rows = [{"question": f"Which fruit is {colour}?", "choices": [fruit, "stone", "cloud"], "answer": 0,
             "target": fruit} for colour, fruit in ITEMS]
    data = folder / "fruits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "tandem_mc.yaml").write_text(
        "task: tandem_mc\n" + common + "output_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\n'
        'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n")
    (folder / "tandem_gen.yaml").write_text(
        "task: tandem_gen\n" + common + "output_type: generate_until\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_target: "{{target}}"\n'
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")


def hf_loglikelihood(model_path, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        logits = _hf_model(str(model_path))(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(logprobs[len(context) + i - 1, t].item() for i, t in enumerate(continuation))


def test_lm_eval_local_completions(disagg, tiny_model, model_id, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", api_key(disagg))  # what local-completions sends as its Bearer key
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    _write_tasks(tmp_path)
    lm = get_model("local-completions")(
        base_url=f"{disagg.http_url}/v1/completions", model=model_id, tokenizer=str(tiny_model),
        tokenizer_backend="huggingface", num_concurrent=1, max_retries=1, batch_size=4, max_length=512,
        timeout=300)  # fmt: skip
    out = lm_eval.simple_evaluate(model=lm, tasks=["tandem_mc", "tandem_gen"], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tmp_path)), limit=10)
    results = out["results"]
    assert 0.0 <= results["tandem_mc"]["acc,none"] <= 1.0
    assert "exact_match,none" in results["tandem_gen"]
    mc = out["samples"]["tandem_mc"]
    assert len(mc) == 10 and len(out["samples"]["tandem_gen"]) == 10
    for sample in mc:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ((loglik, _greedy),) = resp  # one (loglikelihood, is_greedy) per request
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            ref = hf_loglikelihood(tiny_model, ctx_ids, cont_ids)
            assert math.isclose(loglik, ref, abs_tol=1e-4), (context, continuation, loglik, ref)
    assert all(isinstance(s["resps"][0][0], str) for s in out["samples"]["tandem_gen"])
