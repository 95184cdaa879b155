"""Counters of speculative decoding, read by metrics and `tandem status`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    max_k: int
    num_drafts: int = 0
    """Verification passes that carried at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[j]: times the draft token at position j was accepted."""

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * max(self.max_k, 1)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            if j >= len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification pass: accepted drafts + the recovered/bonus token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
