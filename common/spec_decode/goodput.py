"""Whether drafting pays, judged by what it delivers: output tokens per second per sequence.

AdaptiveK prices a draft token from measured step and proposal times (step_cost.py), which is
right when a drafting step and a plain step run on the same hardware. On one box they may not:
while a draft worker drafts, the target may verify on fewer cores (decode --spec-torch-threads),
at a fraction of its memory bandwidth, a cost that the per-token price does not contain. This
governor compares the two kinds of decode steps directly, by moving averages of tokens per
second per sequence, the proposal's time included:

  * while both are measured and drafting steps deliver less than `margin` x plain steps, the
    engine stops drafting; one decision in `probe_every` drafts anyway, so the comparison stays
    current (acceptance and load change);
  * otherwise it drafts, taking one plain step in `probe_every` to keep the plain rate current.

So a draft that cannot pay costs at most about one step in `probe_every` at its own loss.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GoodputGovernor:
    ema: float = 0.2
    """Weight of the newest step in each moving average."""
    margin: float = 0.97
    """Drafting continues while it delivers at least this fraction of the plain rate."""
    min_samples: int = 3
    """Steps of each kind measured before the governor judges."""
    probe_every: int = 16
    spec_rate: float | None = None
    plain_rate: float | None = None
    spec_samples: int = 0
    plain_samples: int = 0
    _decisions: int = 0

    def observe(self, drafted: bool, tokens: int, sequences: int, seconds: float) -> None:
        """One decode-only step: `tokens` output over `sequences` sequences in `seconds`."""
        if sequences <= 0 or seconds <= 0:
            return
        rate = tokens / sequences / seconds
        if drafted:
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

    def allow(self) -> bool:
        """Whether this step may draft (asked once per step that could)."""
        self._decisions += 1
        probe = self._decisions % self.probe_every == 0
        pays = self.drafting_pays
        if pays is None:
            # Still measuring: plain steps come from the cost model's exploration and from
            # requests at k = 0; make sure there are some (one step in 4 until there are).
            return not (self._decisions % 4 == 0 and self.plain_samples < self.min_samples)
        return pays != probe  # the usual choice, and the other one every probe_every decisions
