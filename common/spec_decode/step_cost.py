"""What a draft token costs on this machine, measured, for AdaptiveK's choice of k.

Speculation pays when the extra tokens a pass yields outweigh what the drafts cost: proposing
them (draft model or n-gram, plus any RPC) and scoring them in the target's pass. Both depend on
the hardware and the batch: on a GPU, or a CPU with a good small-batch GEMM, a 5-token pass costs
little more than a 1-token one; on a compute-bound CPU batch it costs ~5x. So the engine
measures instead of assuming:

  * target pass time t(n) = fixed + per_token * n over n scored tokens, fitted by exponentially
    weighted least squares on decode-only steps (prompt chunks cost differently);
  * draft time per proposed token, an exponential moving average over proposer calls.

`draft_token_cost(batch)` prices one draft token in units of one sequence's share of a plain
decode step, `(per_token + draft) / (t(batch) / batch)`: the `c` of AdaptiveK's
`tokens(k) / (1 + c k)`. Until both parts are measured (the fit needs steps of at least two
sizes) it returns None and AdaptiveK keeps its prior. When every request drafts the same k, all
steps have one size and the slope can never be seen, so `should_explore()` asks the engine for an
occasional plain step (no drafts) while the price is unknown: the first as soon as three steps
are measured, then one step in `explore_every`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepCostModel:
    decay: float = 0.95
    """Weight kept by older observations per new one (a half-life of ~14 steps)."""
    draft_ema: float = 0.2
    min_spread: float = 0.5
    """Least standard deviation of observed step sizes (tokens) before the slope is trusted."""
    min_cost: float = 0.01
    max_cost: float = 8.0
    explore_every: int = 16
    _since_explore: int = 0
    _explored: bool = False
    _w: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0
    draft_s_per_token: float | None = None

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target pass over `num_tokens` tokens (plain and draft) took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._sx = self._sx * d + num_tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + num_tokens * num_tokens
        self._sxy = self._sxy * d + num_tokens * seconds

    def observe_proposal(self, num_draft_tokens: int, seconds: float) -> None:
        if num_draft_tokens <= 0 or seconds < 0:
            return
        per_token = seconds / num_draft_tokens
        prev = self.draft_s_per_token
        self.draft_s_per_token = per_token if prev is None else (1 - self.draft_ema) * prev + self.draft_ema * per_token

    def should_explore(self) -> bool:
        """True when this step should go without drafts so the fit sees a second step size.

        The first such step comes as soon as three steps are measured: until then every step
        drafts on the prior, which on a compute-bound batch is a loss on every step."""
        if self._w < 3.0 or self.line() is not None:
            self._since_explore = 0
            return False
        self._since_explore += 1
        if self._since_explore >= self.explore_every or not self._explored:
            self._since_explore, self._explored = 0, True
            return True
        return False

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a target pass, or None while unmeasured."""
        if self._w < 3.0:
            return None
        mean_x, mean_y = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mean_x * mean_x
        if var < self.min_spread**2:
            return None
        slope = max((self._sxy / self._w - mean_x * mean_y) / var, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope

    def draft_token_cost(self, batch_size: int) -> float | None:
        line = self.line()
        if line is None or self.draft_s_per_token is None or batch_size <= 0:
            return None
        fixed, per_token = line
        share = (fixed + per_token * batch_size) / batch_size  # one sequence's part of a plain step
        if share <= 0:
            return None
        return min(max((per_token + self.draft_s_per_token) / share, self.min_cost), self.max_cost)
