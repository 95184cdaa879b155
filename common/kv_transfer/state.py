"""The life cycle of one request's KV transfer, the same on the sending and the receiving side.

    BOOTSTRAPPING --> WAITING --> TRANSFERRING --> SUCCESS
          |              |              |
          +--------------+--------------+-----> FAILED

- BOOTSTRAPPING: the pair is being set up (decode: reservation being made; prefill: handshake
  with decode / opening the PushKV stream).
- WAITING: ready, no KV bytes yet (decode: blocks reserved, lease running; prefill: the first
  prompt chunk is being computed).
- TRANSFERRING: pieces are flowing (at least one sent / accepted).
- SUCCESS: the last piece landed and was verified (decode may run the request).
- FAILED: checksum or compatibility error, abort, lease expiry, peer gone. `reason` says which.

SUCCESS and FAILED are terminal. Illegal transitions are bugs and raise; `fail()` is the one
forgiving call, because aborts race with completion.
"""

from __future__ import annotations

import enum
import threading
import time


class KVTransferState(enum.IntEnum):
    BOOTSTRAPPING = 0
    WAITING = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def is_terminal(self) -> bool:
        return self in (KVTransferState.SUCCESS, KVTransferState.FAILED)


_ALLOWED: dict[KVTransferState, frozenset[KVTransferState]] = {
    KVTransferState.BOOTSTRAPPING: frozenset({KVTransferState.WAITING, KVTransferState.FAILED}),
    KVTransferState.WAITING: frozenset({KVTransferState.TRANSFERRING, KVTransferState.FAILED}),
    KVTransferState.TRANSFERRING: frozenset({KVTransferState.SUCCESS, KVTransferState.FAILED}),
    KVTransferState.SUCCESS: frozenset(),
    KVTransferState.FAILED: frozenset(),
}


def can_transition(current: KVTransferState, target: KVTransferState) -> bool:
    return target in _ALLOWED[current]


class IllegalKVTransitionError(RuntimeError):
    """A transition the state machine forbids: a bug in the caller, not a transfer failure."""


class KVTransferTracker:
    """The state of one request's transfer; enforces the transitions. Safe to share between threads."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._state = KVTransferState.BOOTSTRAPPING
        self._reason = ""
        self._lock = threading.Lock()
        # Monotonic time each state was entered, for metrics (e.g. transfer time).
        self.entered_at: dict[KVTransferState, float] = {KVTransferState.BOOTSTRAPPING: time.monotonic()}

    @property
    def state(self) -> KVTransferState:
        return self._state

    @property
    def reason(self) -> str:
        """Why it failed ("" unless FAILED)."""
        return self._reason

    @property
    def is_terminal(self) -> bool:
        return self._state.is_terminal

    def advance(self, target: KVTransferState) -> None:
        """Moves to target; raises IllegalKVTransitionError if the machine does not allow it.

        Use fail() to enter FAILED (it carries the reason).
        """
        if target is KVTransferState.FAILED:
            raise IllegalKVTransitionError("use fail(reason) to fail a transfer")
        with self._lock:
            if not can_transition(self._state, target):
                raise IllegalKVTransitionError(
                    f"KV transfer of request {self.request_id!r}: {self._state.name} -> {target.name} is not allowed"
                )
            self._state = target
            self.entered_at[target] = time.monotonic()

    def fail(self, reason: str) -> bool:
        """Marks the transfer FAILED with a reason. Returns False (and changes nothing) if it had
        already ended: a late abort after SUCCESS, or a second failure."""
        with self._lock:
            if self._state.is_terminal:
                return False
            self._state = KVTransferState.FAILED
            self._reason = reason
            self.entered_at[KVTransferState.FAILED] = time.monotonic()
            return True

    def __repr__(self) -> str:
        suffix = f", reason={self._reason!r}" if self._reason else ""
        return f"KVTransferTracker({self.request_id!r}, {self._state.name}{suffix})"
