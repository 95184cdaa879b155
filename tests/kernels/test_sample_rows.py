"""The native plain-row sampler (common/kernels/sample_rows.cpp) against its definition: greedy
rows take the first maximal index, drawn rows the inverse CDF of softmax(logits / T) at u (checked
in float64, so float32 rounding in the reference's cumulative sum is not mistaken for an error),
and every row's logprob is log_softmax of the raw logits at the chosen token."""

from __future__ import annotations

import shutil

import pytest
import torch

from common.kernels import native
from common.kernels import sample_rows as sr

CAN_BUILD = native.cpu_unsupported() == "" and shutil.which("g++") is not None
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="needs x86-64 with AVX2 and g++")


def test_kernel_is_available_on_this_machine():
    if not CAN_BUILD:
        assert not sr.available()
        return
    assert sr.available(), sr._kernel.reason


def _check_draw(row: torch.Tensor, temperature: float, u: float, token: int) -> None:
    """token is where u lands in the float64 CDF of softmax(row / T), or within rounding of it."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    cdf = probs.cumsum(-1)
    target = u * cdf[-1].item()
    below = cdf[token - 1].item() if token else 0.0
    slack = 1e-6 * cdf[-1].item()
    assert probs[token] > 0
    assert below - slack <= target < cdf[token].item() + slack, (token, below, target, cdf[token].item())


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 7, 16, 33, 1024, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_matches_the_definition(kernel_variant, vocab, rows):
    g = torch.Generator().manual_seed(vocab * 100 + rows)
    logits = torch.randn(rows, vocab, generator=g) * 4
    temperature = [(0.0, 1.0, 0.6, 1.7)[i % 4] for i in range(rows)]
    for _ in range(5):
        u = torch.rand(rows, generator=g)
        u = u.tolist()
        tokens, logprobs = sr.sample_rows(logits, temperature, u)
        assert sr._kernel.variant == kernel_variant
        raw = torch.log_softmax(logits.double(), dim=-1)
        for i, (tok, t) in enumerate(zip(tokens, temperature)):
            if t == 0.0:
                assert tok == logits[i].argmax().item()
            else:
                _check_draw(logits[i], t, u[i], tok)
            assert logprobs[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)
        ref_tokens, ref_logprobs = sr.reference(logits, temperature, u)
        # The kernel's own accuracy is checked against float64 above; torch's float32 log_softmax over 49k
        # logits is itself ~1e-5 off that (1.1e-5 seen on a Zen 2 EPYC), so the two may differ by both.
        assert logprobs == pytest.approx(ref_logprobs, abs=2e-5)
        # The torch reference sums its CDF in float32: it may differ only at a boundary.
        assert sum(a != b for a, b in zip(tokens, ref_tokens)) <= 1


@needs_kernel
def test_masked_tokens_are_never_drawn_and_ties_take_the_first(kernel_variant):
    logits = torch.full((3, 100), -float("inf"))
    logits[:, 42], logits[:, 77] = 0.0, 1.0
    logits[2, 10] = 1.0  # row 2: a tie with 77 at the top
    for u in (0.0, 0.2, 0.5, 0.999999):
        tokens, logprobs = sr.sample_rows(logits, [1.0, 0.5, 0.0], [u] * 3)
        assert tokens[0] in (42, 77) and tokens[1] in (42, 77) and tokens[2] == 10
    tokens, _ = sr.sample_rows(logits[:1], [1.0], [0.0])
    assert tokens == [42]  # the first token with probability, never a masked one before it
    tokens, _ = sr.sample_rows(logits[:1], [1.0], [0.999999])
    assert tokens == [77]  # the last one with probability, never a masked one after it


@needs_kernel
def test_rows_with_a_stride(kernel_variant):
    # The sampler hands over rows of a larger logits tensor (a view): the row stride is honoured.
    wide = torch.randn(4, 300)
    view = wide[:, :200]
    assert view.stride(0) == 300
    tokens, _ = sr.sample_rows(view, [0.0] * 4, [0.0] * 4)
    assert tokens == view.argmax(-1).tolist()


def test_sampling_frequencies_follow_the_softmax():
    """Many draws of one row land on each token about as often as its probability says (the
    native kernel where it builds, else the reference: what the sampler runs here)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    g = torch.Generator().manual_seed(3)
    n = 20000
    u = torch.rand(n, generator=g).tolist()
    draw = sr.sample_rows if sr.takes(logits) else sr.reference
    counts = torch.zeros(5)
    tokens, _ = draw(logits.expand(n, 5).contiguous(), [0.8] * n, u)
    counts += torch.bincount(torch.tensor(tokens), minlength=5)
    expected = torch.softmax(logits[0] / 0.8, -1) * n
    assert torch.all((counts - expected).abs() <= 5 * expected.sqrt() + 1)
