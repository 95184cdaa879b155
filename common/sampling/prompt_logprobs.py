"""Prompt log-probabilities: how likely the model found each prompt token, given the ones before.

Position p's logits predict token p + 1, so a prompt of P tokens has P - 1 of them (the first token
has none; OpenAI's echo and vLLM's prompt_logprobs report it as null). They are computed under the
model's raw logits, like the sampler's logprobs, for all the rows of a step in one log_softmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (token id, logprob, [(top token id, logprob), ...] most likely first)
PromptLogprob = tuple[int, float, list[tuple[int, float]]]


def compute_prompt_logprobs(logits: torch.Tensor, targets: Sequence[int], num_top: Sequence[int]) -> list[PromptLogprob]:
    """logits: [R, V] raw logits at R positions; targets[r]: the token that followed position r;
    num_top[r]: how many alternatives to return for that row."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [R, V]
    target = torch.tensor(list(targets), dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, target.unsqueeze(1)).squeeze(1).tolist()  # [R]
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_ids: list[list[int]] = [[] for _ in targets]
    top_vals: list[list[float]] = [[] for _ in targets]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    return [
        (int(t), lp, list(zip(top_ids[r][: num_top[r]], top_vals[r][: num_top[r]])))
        for r, (t, lp) in enumerate(zip(targets, chosen))
    ]
