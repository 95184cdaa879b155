"""Stop strings over streamed text, including matches that span token boundaries.

The matcher keeps the text it has not released yet. Each call appends the new text, looks for a
stop string in that buffer, and otherwise releases everything except the longest tail that is a
proper prefix of some stop string: that tail might still become a stop, so it is never streamed.

    released        | held
    "The answer is" | " EN"        stop = [" END"]: " EN" may still grow into " END"

Since a released part never ends with a stop prefix, no stop can begin in released text, so
searching the buffer alone is complete. Among matches we take the one that ends first (then the
longest): that is the stop a character-by-character scan would hit, so the result does not
depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    text: str  # newly releasable text (already cut at the stop string when one matched)
    stop: str | None  # the stop string that matched; the request should finish


class StopStringMatcher:
    """Finds the first stop string in a request's generated text, streaming-safe."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def held_text(self) -> str:
        """Text received but not released, because it could be the start of a stop string."""
        return self._held

    def add_text(self, new_text: str) -> StopCheck:
        """Appends generated text; returns what may be streamed now and the stop, if one hit."""
        if self.matched is not None:
            return StopCheck("", self.matched)
        if not self.stop:
            return StopCheck(new_text, None)
        buffer = self._held + new_text
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for s in self.stop:
            start = buffer.find(s)
            if start >= 0:
                key = (start + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, neg_len, s = best
            self.matched = s
            self._held = ""
            cut = end if self.include_stop_str_in_output else end + neg_len
            return StopCheck(buffer[:cut], s)
        hold = self._partial_stop_len(buffer)
        self._held = buffer[len(buffer) - hold :]
        return StopCheck(buffer[: len(buffer) - hold], None)

    def flush(self) -> str:
        """The request ended without a stop string: the held tail is plain text after all."""
        held, self._held = self._held, ""
        return held

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
