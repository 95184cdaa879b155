"""Whether drafting pays, judged by what it delivers: output tokens per second per sequence.

AdaptiveK prices a draft token from measured step and proposal times (step_cost.py), which is
right when a drafting step and a plain step run on the same hardware. On one box they may not:
while a draft worker drafts, the target may verify on fewer cores (decode --spec-torch-threads),
at a fraction of its memory bandwidth, a cost that the per-token price does not contain. This
governor compares the two kinds of decode steps directly, by moving averages of tokens per
second per sequence, the proposal's time included:

  * while both are measured and drafting steps deliver less than `margin` x plain steps, the
    engine stops drafting, but now and then drafts a burst of `probe_len` steps, so the
    comparison stays current (acceptance and load change). With a draft model only new requests
    can join a burst (the engine never resumes a request whose drafting lapsed: the draft would
    have to ingest every token since, see SpeculationMixin._propose), so a burst that finds no
    one to draft for waits, ready, until a drafting step happens. Each burst that still finds
    drafting a loss doubles the wait before the next (`burst_wait`, 64 decisions, up to
    `max_burst_wait`, 1024): a burst costs the draft's ingestion of a new request's prompt,
    and a draft that cannot pay should cost next to nothing;
  * otherwise it drafts, taking one plain step in `probe_every` to keep the plain rate current;
  * either way, a measurement that nothing refreshes goes stale: where no drafting step has been
    seen for the same wait (drafting pays by the last measurement, yet no request starts, because
    the engine judges a new request's start by what the last workload delivered), a burst comes
    due too. While a burst is due (`exploring`) the engine's start check values a new request
    as a new workload's, not by the stale numbers (only the measured price of the draft's
    ingestion can still refuse it): a prior that only drafting can update must not be able to
    lock drafting out, as prose, where this draft accepts half its tokens, did for chat after it
    (Qwen2.5-Coder 1.5B/0.5B at batch 1: 1.10x with no draft token, 1.59x with bursts exploring).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class GoodputGovernor:
    ema: float = 0.2
    """Weight of the newest step in each moving average."""
    margin: float = 0.97
    """Drafting continues while it delivers at least this fraction of the plain rate."""
    min_samples: int = 3
    """Steps of each kind measured before the governor judges."""
    probe_every: int = 16
    """Decisions between plain probes while drafting pays."""
    burst_wait: int = 64
    """Decisions before the first probe burst once drafting is found to lose; doubled after each
    burst that still finds a loss, up to max_burst_wait. A burst costs the draft's ingestion of a
    new request's prompt and a few losing steps (~2 s at batch 4 on the CPU): rare on purpose."""
    max_burst_wait: int = 1024
    probe_len: int = 3
    """Drafting steps measured by a probe burst."""
    spec_rate: float | None = None
    plain_rate: float | None = None
    spec_predicted: float | None = None
    """Moving average of what the cost model predicted drafting steps would deliver (a ratio to
    plain steps), beside spec_rate: measured / predicted calibrates the model (calibrated())."""
    spec_samples: int = 0
    plain_samples: int = 0
    _decisions: int = 0
    _wait: int = 0  # decisions between bursts now (burst_wait, doubling while no burst finds a gain)
    _since_drafted: int = 0  # decisions since the last drafting step was observed
    _burst_left: int = 0  # drafting steps the current burst still wants measured

    def observe(self, drafted: bool, tokens: int, sequences: int, seconds: float, predicted: float | None = None) -> None:
        """One decode-only step: `tokens` output over `sequences` sequences in `seconds`;
        `predicted`: the cost model's expected ratio to a plain step, for a drafting step."""
        if sequences <= 0 or seconds <= 0:
            return
        rate = tokens / sequences / seconds
        if drafted:
            if predicted is not None and predicted > 0:
                prev = self.spec_predicted
                self.spec_predicted = predicted if prev is None else prev + self.ema * (predicted - prev)
            if self._burst_left > 0:
                self._burst_left -= 1
            else:
                self._wait = 0  # drafting of the engine's own accord: the wait starts over
            self._since_drafted = 0
            self.spec_rate = rate if self.spec_rate is None else self.spec_rate + self.ema * (rate - self.spec_rate)
            self.spec_samples += 1
        else:
            self.plain_rate = rate if self.plain_rate is None else self.plain_rate + self.ema * (rate - self.plain_rate)
            self.plain_samples += 1

    @property
    def drafting_pays(self) -> bool | None:
        """None until both kinds of steps are measured."""
        if self.spec_samples < self.min_samples or self.plain_samples < self.min_samples:
            return None
        assert self.spec_rate is not None and self.plain_rate is not None
        return self.spec_rate >= self.margin * self.plain_rate

    def calibrated(self, predicted: float) -> float:
        """A predicted ratio of drafting to plain steps, corrected by how far measured drafting
        steps fell short of (or beat) their predictions here; unchanged until both are measured."""
        if self.drafting_pays is None or not self.spec_predicted or not self.plain_rate:
            return predicted
        assert self.spec_rate is not None
        return predicted * (self.spec_rate / self.plain_rate) / self.spec_predicted

    def allow(self) -> bool:
        """Whether this step may draft (asked once per step that could)."""
        self._decisions += 1
        pays = self.drafting_pays
        if pays is None:
            # Still measuring: plain steps come from the cost model's exploration and from
            # requests at k = 0; make sure there are some (one step in 4 until there are).
            return not (self._decisions % 4 == 0 and self.plain_samples < self.min_samples)
        if self._burst_left > 0:
            return True  # a burst in progress (or waiting for a step that drafts)
        self._since_drafted += 1
        wait = self._wait or self.burst_wait
        if self._since_drafted >= wait:
            self._burst_left = self.probe_len
            self._wait = min(2 * wait, self.max_burst_wait)
            return True
        if pays:
            return self._decisions % self.probe_every != 0  # one plain step in probe_every
        return False

    @property
    def exploring(self) -> bool:
        """A burst is due or under way: the engine judges new requests' starts as a new
        workload's (SpeculationMixin._starts_worth), so the stale measurement can change."""
        return self._burst_left > 0


@dataclass(slots=True)
class GovernorsByBatch:
    """One governor per batch-size class (1, 2-3, 4-7, 8-15, ...): whether drafting pays depends on
    the batch (at 1 the target streams its weights for one token; at 16 a CPU pass is
    compute-bound and verifying drafts costs nearly their share), and rates per sequence at one
    batch say nothing about another."""

    governors: dict[int, GoodputGovernor] = field(default_factory=dict)

    def for_batch(self, num_sequences: int) -> GoodputGovernor:
        key = max(1, num_sequences).bit_length()
        governor = self.governors.get(key)
        if governor is None:
            governor = self.governors[key] = GoodputGovernor()
        return governor
