"""What a draft token costs on this machine, measured, for AdaptiveK's choice of k.

Speculation pays when the extra tokens a pass yields outweigh what the drafts cost: proposing
them (draft model or n-gram, plus any RPC) and scoring them in the target's pass. Both depend on
the hardware and the batch: on a GPU, or a CPU with a good small-batch GEMM, a 5-token pass costs
little more than a 1-token one; on a compute-bound CPU batch it costs ~5x. So the engine
measures instead of assuming:

  * target pass time t(n) = fixed + per_token * n over n scored tokens, fitted by exponentially
    weighted least squares on decode-only steps (prompt chunks cost differently);
  * draft time per draft position d(s) = fixed + per_seq * s for a call drafting for s sequences,
    fitted the same way over proposer calls. A draft model drafts all of a call's sequences
    together, one batched step per position, so at small batches (memory-bound: each step
    streams the draft's weights) a position costs about the same for 1 sequence as for 4. Until
    calls of two sizes are seen, d is the mean per position (that memory-bound assumption);
  * the draft's catch-up (ingesting a new request's prompt), seconds per ingested token.

`draft_token_cost(batch)` prices one draft token in units of one sequence's share of a plain
decode step, `(per_token + d(batch) / batch) / (t(batch) / batch)`, with every sequence of the
batch drafting: the `c` of AdaptiveK's `tokens(k) / (1 + c k)`. Until both parts are measured
(the fit needs steps of at least two sizes) it returns None and AdaptiveK keeps its prior. When
every request drafts the same k, all steps have one size and the slope can never be seen, so
`should_explore()` asks the engine for an occasional plain step (no drafts) while the price is
unknown: the first as soon as three steps are measured, then one step in `explore_every`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class DecayingLine:
    """y = fixed + slope * x by exponentially weighted least squares (newest weighs most)."""

    decay: float = 0.95
    """Weight kept by older observations per new one (a half-life of ~14)."""
    min_spread: float = 0.5
    """Least standard deviation of the observed x before the slope is trusted."""
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y

    @property
    def mean_y(self) -> float | None:
        return self.sy / self.w if self.w > 0 else None

    def fit(self, min_weight: float = 3.0) -> tuple[float, float] | None:
        """(fixed, slope), or None while fewer than `min_weight` observations or one x only."""
        if self.w < min_weight:
            return None
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mean_x * mean_x
        if var < self.min_spread**2:
            return None
        slope = max((self.sxy / self.w - mean_x * mean_y) / var, 0.0)
        return max(mean_y - slope * mean_x, 0.0), slope


@dataclass(slots=True)
class StepCostModel:
    ingest_ema: float = 0.2
    """EMA weight of the newest catch-up measurement."""
    min_cost: float = 0.01
    max_cost: float = 8.0
    explore_every: int = 16
    _since_explore: int = 0
    _explored: bool = False
    target: DecayingLine = field(default_factory=DecayingLine)
    """Target pass seconds over scored tokens."""
    draft: DecayingLine = field(default_factory=lambda: DecayingLine(min_spread=1.0))
    """Draft seconds per position over the sequences a call drafted for."""
    ingest_s_per_token: float | None = None
    """The draft's catch-up: seconds per context token it ingests (a new request's prompt)."""
    _last_line: tuple[float, float] | None = None

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A decode-only target pass over `num_tokens` tokens (plain and draft) took `seconds`."""
        if num_tokens > 0 and seconds > 0:
            self.target.observe(num_tokens, seconds)
            self._last_line = self.target.fit() or self._last_line

    def observe_proposal(self, num_sequences: int, positions: int, seconds: float) -> None:
        """A steady proposer call (no catch-up): up to `positions` drafts for each of
        `num_sequences` sequences in `seconds`."""
        if num_sequences > 0 and positions > 0 and seconds >= 0:
            self.draft.observe(num_sequences, seconds / positions)

    def observe_catch_up(self, ingested_tokens: int, num_sequences: int, positions: int, seconds: float) -> None:
        """A call in which the draft first ingested `ingested_tokens` context tokens it had not
        seen: what drafting itself would have taken is subtracted where it is known."""
        if ingested_tokens <= 0 or seconds <= 0:
            return
        drafting = self.draft_s_per_position(num_sequences)
        per_token = max(seconds - (drafting or 0.0) * positions, 0.0) / ingested_tokens
        prev = self.ingest_s_per_token
        self.ingest_s_per_token = per_token if prev is None else (1 - self.ingest_ema) * prev + self.ingest_ema * per_token

    def should_explore(self) -> bool:
        """True when this step should go without drafts so the fit sees a second step size.

        The first such step comes as soon as three steps are measured: until then every step
        drafts on the prior, which on a compute-bound batch is a loss on every step."""
        if self.target.w < 3.0 or self._last_line is not None:
            self._since_explore = 0
            return False
        self._since_explore += 1
        if self._since_explore >= self.explore_every or not self._explored:
            self._since_explore, self._explored = 0, True
            return True
        return False

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a target pass, or None while unmeasured. Once
        fitted, the last fit stands while recent steps all have one size (a batch decoding
        plain for a long while): the slope cannot be seen then, but it has not gone away."""
        return self._last_line

    def draft_s_per_position(self, num_sequences: int) -> float | None:
        """Seconds of one draft position for a call drafting for `num_sequences` (None: unmeasured)."""
        fit = self.draft.fit(min_weight=2.0)
        if fit is None:
            return self.draft.mean_y
        fixed, per_seq = fit
        return fixed + per_seq * num_sequences

    def step_share(self, batch_size: int) -> float | None:
        """One sequence's share of a plain decode step at this batch, in seconds."""
        line = self.line()
        if line is None or batch_size <= 0:
            return None
        fixed, per_token = line
        share = (fixed + per_token * batch_size) / batch_size
        return share if share > 0 else None

    def draft_token_cost(self, batch_size: int) -> float | None:
        share = self.step_share(batch_size)  # None while the line is unmeasured
        draft = self.draft_s_per_position(batch_size)
        if share is None or draft is None:
            return None
        per_token = self.line()[1]
        return min(max((per_token + draft / batch_size) / share, self.min_cost), self.max_cost)

    def step_ratio(self, batch_size: int, draft_ks: list[int]) -> float | None:
        """Predicted time of a decode step at this batch with these sequences drafting k tokens
        each (a draft call of max(k) positions, sum(k) more tokens scored) over a plain step's;
        None while unmeasured."""
        line = self.line()
        draft = self.draft_s_per_position(len(draft_ks)) if draft_ks else 0.0
        if line is None or draft is None or batch_size <= 0:
            return None
        fixed, per_token = line
        plain = fixed + per_token * batch_size
        if plain <= 0:
            return None
        return (plain + per_token * sum(draft_ks) + draft * max(draft_ks, default=0)) / plain

    def ingest_cost(self, num_tokens: int) -> float | None:
        """Seconds the draft would take to ingest `num_tokens` of context it has not seen. Before
        a catch-up was measured: the target's own price of a token in a pass (a draft is smaller
        than its target, so that errs high); None while that is unknown too."""
        per_token = self.ingest_s_per_token
        if per_token is None:
            line = self.line()
            per_token = None if line is None else line[1]
        return None if per_token is None else per_token * num_tokens
