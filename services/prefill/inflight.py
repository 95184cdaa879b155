"""The requests a prefill worker holds, and the engine hook that ships their computed blocks.

A request's life on prefill:

    RECEIVING (prompt chunks arriving; counts as queued tokens)
      -> COMPUTING (in the engine; each step's span -> blocks copied -> KVSender)
      -> FINISHING (first token sampled; last piece sent, waiting for decode's verdict)
      -> done | failed | aborted (engine request aborted, PushKV cancelled, table entry removed)

`SpanRouter` is the engine's `on_computed` hook. It runs on the engine thread after each model
pass, before any request of the step is freed, so the blocks it copies are still the request's.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from common.engine.llm_engine import ComputedSpan
from common.kv_cache.paged_cache import PagedKVCache
from services.prefill.block_shipping import ShipCursor
from services.prefill.errors import PrefillError
from services.prefill.kv_sender import KVBatch, KVSender
from services.runtime.metrics import ServiceMetrics


@dataclass(frozen=True, slots=True)
class Computed:
    """Event: prompt positions [0, num_computed_tokens) now have KV on prefill."""

    num_computed_tokens: int


@dataclass(slots=True)
class InflightRequest:
    request_id: str
    num_prompt_tokens: int = 0
    """Prompt tokens received so far (all of them once the prompt is complete)."""
    num_computed_tokens: int = 0
    """Written by the engine thread."""
    cursor: ShipCursor | None = None
    sender: KVSender | None = None
    events: asyncio.Queue | None = None
    """The EngineLoop stream queue: engine outputs, Computed events and failures, in order."""
    failure: PrefillError | None = None
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    @property
    def computing(self) -> bool:
        return self.events is not None

    def fail(self, error: PrefillError) -> None:
        """Event loop: the first failure wins; it ends the request's stream."""
        if self.failure is None:
            self.failure = error
            if self.events is not None:
                self.events.put_nowait(error)  # EngineLoop.stream raises exceptions it receives

    def fail_threadsafe(self, error: PrefillError) -> None:
        self.loop.call_soon_threadsafe(self.fail, error)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_queued_tokens: int
    num_running: int
    num_transfers_in_flight: int


class InflightTable:
    """request id -> InflightRequest; read by the engine thread, written on the event loop."""

    def __init__(self) -> None:
        self._requests: dict[str, InflightRequest] = {}
        self._lock = threading.Lock()

    def add(self, request: InflightRequest) -> bool:
        with self._lock:
            if request.request_id in self._requests:
                return False
            self._requests[request.request_id] = request
            return True

    def get(self, request_id: str) -> InflightRequest | None:
        return self._requests.get(request_id)

    def remove(self, request: InflightRequest) -> None:
        with self._lock:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]

    def __len__(self) -> int:
        return len(self._requests)

    def load(self) -> LoadSnapshot:
        with self._lock:
            requests = list(self._requests.values())
        return LoadSnapshot(
            num_queued_tokens=sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in requests),
            num_running=len(requests),
            num_transfers_in_flight=sum(1 for r in requests if r.sender is not None and not r.sender.done),
        )


class SpanRouter:
    """engine.on_computed: copy each request's newly computed blocks and hand them to its sender."""

    def __init__(self, table: InflightTable, kv_cache: PagedKVCache, metrics: ServiceMetrics) -> None:
        self.table = table
        self.kv_cache = kv_cache
        self.metrics = metrics

    def __call__(self, spans: list[ComputedSpan]) -> None:
        now = time.monotonic()
        for span in spans:
            self.metrics.prefill_tokens.inc(span.end - span.start)
            request = self.table.get(span.request_id)
            if request is None or request.cursor is None or request.sender is None or request.events is None:
                continue
            request.num_computed_tokens = span.end
            batch = request.cursor.advance(span.end, span.block_ids)
            if batch is not None and batch.local_block_ids:
                # A copy: the blocks may be freed and reused by the next step.
                kv = self.kv_cache.read_blocks(batch.local_block_ids)  # [layers, 2, n, block_size, kv_heads, head_dim]
                request.sender.push_threadsafe(KVBatch(kv, batch.dest_block_ids, now))
            request.loop.call_soon_threadsafe(request.events.put_nowait, Computed(span.end))
