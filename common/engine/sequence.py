"""The engine's per-choice state: the scheduler's Request plus sampling and text state."""

from __future__ import annotations

from dataclasses import dataclass

from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.sampler import SamplingState
from common.sampling.stop_strings import StopStringMatcher
from common.scheduler.request import Request


@dataclass(slots=True)
class EngineSequence:
    request: Request
    parent_id: str
    index: int
    state: SamplingState
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    text: str = ""
