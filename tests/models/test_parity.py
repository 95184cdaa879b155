"""End-to-end parity of our decoder against transformers for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from common.models.loader import load_model
from tests.models.paged_helpers import PagedRunner, greedy_generate

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "granite")
# The reference is transformers run in float64. Float32 implementations differ from it by their
# summation order, which these sharp random-weight models amplify: transformers' own float32
# logits are up to ~2e-4 off (qwen2), ours ~6e-5 with the small-batch CPU GEMM and bit-equal to
# transformers' float32 with torch's linear (TANDEM_CPU_GEMM=off, or a CPU without AVX2). Each
# test runs with both builds of the CPU kernels (kernel_variant: AVX2 and AVX-512).
ATOL = 3e-4
PROMPT_A = "The lighthouse keeper wrote 42 numbers in the café. 今天天气很好 🚀 def count(x): return x + 1"
PROMPT_B = "Le garçon répète « déjà vu » 😀 and the river ran brown"


@pytest.fixture(scope="module")
def models(model_factory):
    """arch -> (ours, cfg, hf, tokenizer), loaded once for the module."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            path = model_factory(arch)
            ours, cfg = load_model(path, dtype="float32")
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="sdpa")
            loaded[arch] = (ours, cfg, hf.eval(), AutoTokenizer.from_pretrained(path))
        return loaded[arch]

    return get


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [T, vocab], computed in float64
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prompt_logits_match(models, kernel_variant, arch):
    ours, cfg, hf, tok = models(arch)
    ids = tok(PROMPT_A)["input_ids"]
    ours_logits = PagedRunner(ours, cfg).step({0: ids})[0]
    torch.testing.assert_close(ours_logits, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_batched_decode_match(models, kernel_variant, arch):
    ours, cfg, hf, tok = models(arch)
    a, b = tok(PROMPT_A)["input_ids"], tok(PROMPT_B)["input_ids"]
    assert len(a) > 30 and 12 < len(b) < len(a)
    runner = PagedRunner(ours, cfg, seed=1)
    # Chunks of odd sizes that straddle block edges; the second step mixes both sequences.
    got_a = runner.step({0: a[:7]})
    mixed = runner.step({0: a[7:20], 1: b[:5]})
    got_a += [mixed[0], *runner.step({0: a[20:]})]
    got_b = [mixed[1], *runner.step({1: b[5:]})]
    assert runner.tables[0] != sorted(runner.tables[0])  # the cache really is scattered
    torch.testing.assert_close(torch.cat(got_a), hf_logits(hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(got_b), hf_logits(hf, b), atol=ATOL, rtol=0)

    # Decode the two sequences together; compare each step with a full HF pass over the text so far.
    seqs = {0: list(a), 1: list(b)}
    last = {0: got_a[-1][-1], 1: got_b[-1][-1]}
    decode_logits: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    for _ in range(4):
        step = {s: [int(last[s].argmax())] for s in seqs}
        for s, tokens in step.items():
            seqs[s] += tokens
        out = runner.step(step)
        for s, logits in zip(step, out):
            last[s] = logits[-1]
            decode_logits[s].append(logits[-1])
    for s, ids in seqs.items():
        expected = hf_logits(hf, ids)[-4:]
        torch.testing.assert_close(torch.stack(decode_logits[s]), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_matches_generate(models, kernel_variant, arch):
    ours, cfg, hf, tok = models(arch)
    for prompt in ("The river ran", "<|im_start|>user\nBonjour, 你好!<|im_end|>\n<|im_start|>assistant\n"):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)[0, len(ids) :].tolist()
        got = greedy_generate(PagedRunner(ours, cfg), ids, 20, cfg.eos_token_ids)
        assert got == expected
        assert len(set(got)) >= 10, f"{arch}: greedy output collapsed: {got}"
