"""Sampling for rows whose logits need no edits, in one native call (sample_rows.cpp).

The sampler (common/sampling/sampler.py) hands this the rows of a step that sample plainly: no
penalties, bias, grammar, min_tokens mask, top-k / top-p / min-p, or top logprobs. Each gets its
token (greedy, or drawn from softmax(logits / T) by inverse CDF with a uniform u the sampler draws
from the request's generator, as on the torch path) and that token's raw log-probability.
`reference` is the same in PyTorch: what the kernel is tested against, and what runs where the
kernel cannot be built (no compiler, not x86, TANDEM_CPU_GEMM=off) or the logits are not on the CPU.
"""

from __future__ import annotations

import ctypes

import torch

from common.kernels import native


def _declare(fn) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, i64, i64, p, p, p, p, ctypes.c_int]
    fn.restype = ctypes.c_int


_kernel = native.NativeFunction("sample_rows.cpp", "tandem_sample_rows", _declare)


def available() -> bool:
    return bool(_kernel.get())


def takes(logits: torch.Tensor) -> bool:
    """Whether the native call takes these logits (float32 rows on the CPU, the kernel built)."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 and available()


def sample_rows(logits: torch.Tensor, temperature: list[float], u: list[float],
                variant: str | None = None) -> tuple[list[int], list[float]]:  # fmt: skip
    """(token per row, its raw logprob per row). logits [N, V] float32 CPU, rows contiguous;
    temperature per row (0: greedy); u per row, uniforms in [0, 1) (ignored for greedy rows)."""
    fn = _kernel.get(variant)
    if not fn:
        raise RuntimeError(f"sample_rows kernel unavailable: {_kernel.reason_for(variant)}")
    n, vocab = logits.shape
    # ctypes arrays, not tensors: at decode batch sizes four tensor round trips cost more than the call.
    floats = ctypes.c_float * n
    tokens, logprobs = (ctypes.c_int64 * n)(), floats()
    fn(logits.data_ptr(), logits.stride(0), n, vocab, floats(*temperature), floats(*u), tokens, logprobs,
       torch.get_num_threads())  # fmt: skip
    return list(tokens), list(logprobs)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token per row: the first index whose cumulative probability exceeds u * row total.
    probs: [R, V] (unnormalised is fine), u: [R] in [0, 1). A zero-probability token is never
    picked: the returned index always has cdf[i] > cdf[i - 1]."""
    cdf = probs.cumsum(dim=-1)  # [R, V]
    target = (u * cdf[:, -1]).unsqueeze(1)  # [R, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def reference(logits: torch.Tensor, temperature: list[float], u: list[float]) -> tuple[list[int], list[float]]:
    """What sample_rows computes, in PyTorch (the sampler's own inverse-CDF draw)."""
    logits = logits.to(torch.float32)
    tokens = logits.argmax(dim=-1)
    drawn = [i for i, t in enumerate(temperature) if t > 0.0]
    if drawn:
        rows = torch.tensor(drawn, device=logits.device)
        temps = torch.tensor([temperature[i] for i in drawn], device=logits.device).unsqueeze(1)
        probs = torch.softmax(logits[rows] / temps, dim=-1)
        tokens[rows] = inverse_cdf(probs, torch.tensor([u[i] for i in drawn], device=logits.device))
    chosen = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()
