"""Runs an LLMEngine on its own thread so asyncio services can stream from it.

    asyncio (gRPC / HTTP handlers)                 engine thread
    ------------------------------                 -------------
    stream = loop.generate(...)  ── command ──▶    engine.add_request
    async for out in stream      ◀── outputs ──    engine.step() (while there is work)
    await loop.call(fn)          ── command ──▶    fn(engine) between two steps

The engine is not thread-safe: every touch of it happens on the engine thread, between steps.
Outputs go back to per-request asyncio queues, one call_soon_threadsafe per step; a stream
whose consumer fell behind merges what piled up (each choice's tokens into one output). A stream
that is closed early (client gone) aborts its request, so its blocks are freed within a step.

Streaming interval: where decode steps are short (a small model), the per-step cost of handing
outputs over (a wake-up of the event loop, a gRPC message per request, an SSE event at the
gateway) is larger than the step itself. With `stream_interval_s` > 0 the thread keeps stepping
a batch that only decodes for up to that long, then hands over every token of those steps at
once (one message a request, several tokens in it): the tokens reach the client together, at
most that much later. Only steps of one token per sequence run on: a step that computed a prompt
hands its first tokens over at once, so does a step that finished a request, and a new request,
an abort or any other command ends the run, as does a waiting or prefilling request (its prompt
is not held back behind decode steps). So does a step that may bring a request's first visible
text (`text_tokens`, set once the decode worker has loaded its tokenizer): while a request's
tokens so far show no text on their own (a special token, one byte of a character), its next
tokens go out step by step, so a client's first text is not held back a whole interval.

First tokens are handed over before the next step: after a step that made a request's first
token, with at most FIRST_TOKEN_HANDOFF_MAX_RUNNING sequences running, the thread waits (at most
`first_token_handoff_s`, 2 ms) until the event loop has run the tasks that token woke, i.e. sent
it on, before it steps again. Otherwise the next decode step took the cores and the GIL while the
first token crossed the event loop, the socket, the gateway and the client: the tiny model's TTFT
at one stream with 64-token requests 9.27 -> 7.68 ms (p50, paired ratio 0.833,
benchmarks/commit_ab.py), the whole request unchanged (38.5 -> 38.3 ms). With more sequences
running the pause holds all of them up for one request's gain: at 4 streams TTFT p50 18.7 / 19.4
ms without it vs 20.0 / 21.7 with it, at 64 streams 4826 / 4834 vs 4554 / 4605 tok/s (guidellm,
tiny, A B B A), so there the thread steps on at once.

Liveness: the thread stamps `last_beat` every turn of its loop (at least every 50 ms when idle),
so `unresponsive_for()` grows only while one step or command hangs; services/runtime/liveness.py
turns that into grpc.health.v1 NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from common.engine.llm_engine import CompletionOutput, LLMEngine
from common.engine.outputs import coalesce
from common.sampling.params import SamplingParams
from common.sampling.text_tokens import TextTokens

logger = logging.getLogger(__name__)
T = TypeVar("T")

_FINISHED = object()
FIRST_TOKEN_HANDOFF_S = 0.002
FIRST_TOKEN_HANDOFF_MAX_RUNNING = 2


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine", stream_interval_s: float = 0.0) -> None:
        self.engine = engine
        self.stream_interval_s = stream_interval_s
        """Most seconds a step's outputs wait while the thread runs more decode steps (0: none)."""
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_listeners: list[Callable[[LLMEngine], None]] = []
        """Called on the engine thread after every step (metrics, leases)."""
        self.text_tokens: TextTokens | None = None
        """Which tokens show text alone; with it, a request's first text is never held back by
        the streaming interval (None: every token counts as text)."""
        self.first_token_handoff_s = FIRST_TOKEN_HANDOFF_S
        """Most seconds the thread waits, after a step that made first tokens, for the event loop
        to send them before it steps on (module docstring)."""
        self.last_error: BaseException | None = None
        self.last_beat = time.monotonic()
        # Grammar compiles get threads of their own: a burst of structured requests (the first
        # one builds the compiler, ~2 s of imports, and the rest wait on it) must not fill the
        # loop's default executor, which other work of the service (heartbeats, aborts) needs.
        self._prepare_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{name}-prepare")

    def unresponsive_for(self) -> float:
        """Seconds since the engine thread last came round its loop (0 when it is not running)."""
        return max(0.0, time.monotonic() - self.last_beat) if self._thread.is_alive() else 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)

    # -- calls from asyncio -----------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as e:  # handed back to the caller, not swallowed
                loop.call_soon_threadsafe(_set_exception, fut, e)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._submit(run)
        return await fut

    def is_streaming(self, request_id: str) -> bool:
        """A stream is open for request_id (its handler got past admission)."""
        return request_id in self._streams

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Registers the queue that will receive request_id's outputs (call before adding it)."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[CompletionOutput]:
        """Yields outputs until every choice finished; aborts the request if the consumer leaves."""
        done = False
        try:
            while True:
                items = [await q.get()]
                while not q.empty():  # the consumer fell behind: what piled up goes on as one output
                    items.append(q.get_nowait())
                for item in coalesce(items) if len(items) > 1 else items:
                    if item is _FINISHED:
                        done = True
                        return
                    if isinstance(item, BaseException):
                        done = True
                        raise item
                    yield item
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._submit(lambda: self.engine.abort_request(request_id))

    async def prepare(self, params: SamplingParams | None) -> None:
        """Work a request needs before the engine may take it, done off the engine thread: compiling
        its grammar (bounded by the compile timeout). Raises the engine's RequestError."""
        if params is not None and params.grammar is not None:
            await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.engine.compile_grammar, params)

    async def generate(self, request_id: str, **add_kwargs: Any) -> AsyncIterator[CompletionOutput]:
        """add_request + stream. Raises the engine's RequestError before yielding on bad input."""
        q = self.open_stream(request_id)
        try:
            await self.prepare(add_kwargs.get("params"))
            await self.call(lambda e: e.add_request(request_id, **add_kwargs))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        async for out in self.stream(request_id, q):
            yield out

    async def abort(self, request_id: str) -> bool:
        found = await self.call(lambda e: e.abort_request(request_id))
        self._finish_stream(request_id)
        return found

    def deliver(self, outputs: list[CompletionOutput]) -> None:
        """Engine thread: hands outputs produced outside step() (e.g. commit_remote) to streams."""
        self._dispatch(outputs)

    # -- engine thread ----------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self.last_beat = time.monotonic()
            self._drain_commands()
            if not self.engine.scheduler.has_work():
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                for listener in self.step_listeners:
                    listener(self.engine)
                continue
            outputs: list[CompletionOutput] = []
            try:
                self._steps(outputs)
            except Exception as e:  # a broken step fails its requests, not the process
                logger.exception("engine step failed")
                self.last_error = e
                self._dispatch(outputs)  # what earlier steps of the run produced (finished requests)
                self._fail_all(e)
                continue
            taken = self._dispatch(outputs)
            if (taken is not None and self.engine.scheduler.has_work()
                    and self.engine.scheduler.num_running <= FIRST_TOKEN_HANDOFF_MAX_RUNNING):
                taken.wait(self.first_token_handoff_s)

    def _steps(self, outputs: list[CompletionOutput]) -> None:
        """One step, then more while the streaming interval allows; appends their outputs."""
        started = time.perf_counter()
        while True:
            step_outputs = self.engine.step()
            outputs.extend(step_outputs)
            for listener in self.step_listeners:
                listener(self.engine)
            if self.stream_interval_s <= 0:
                return
            last = self.engine.last_step
            # The next step is predicted to take as long as this one (a decode step's cost moves
            # little from one to the next); stop where it would end past the interval.
            if time.perf_counter() + last.total - started > self.stream_interval_s:
                return
            if any(o.finished for o in step_outputs):
                return  # a finished request's last tokens and usage go out at once
            if last.num_tokens != last.num_seqs:  # a prompt (a first token goes out at once) or drafts
                return
            if not self._commands.empty() or not self._decoding_only():
                return
            if self._may_start_text(step_outputs):
                return  # a request's first visible text goes out at once (it is the client's TTFT)

    def _may_start_text(self, outputs: list[CompletionOutput]) -> bool:
        text_tokens = self.text_tokens
        if text_tokens is None:
            return False
        return any(text_tokens.awaits_text(o.token_ids, len(o.new_token_ids)) for o in outputs)

    def _decoding_only(self) -> bool:
        """Every request is running and has at most its next token to compute (no prompt left)."""
        scheduler = self.engine.scheduler
        if scheduler.waiting or not scheduler.running:
            return False
        return all(r.num_tokens - r.num_computed_tokens <= 1 for r in scheduler.running)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            fn()

    def _dispatch(self, outputs: list[CompletionOutput]) -> threading.Event | None:
        # One wake-up of each event loop per step, not one per output: every call_soon_threadsafe
        # writes the loop's self-pipe, and each write can hand the GIL to the loop's thread. A
        # request's outputs of a run of steps are merged here (as its consumer would merge them,
        # finding them queued at once), so the loop's thread, which takes the GIL from this one,
        # gets one item per request instead of one per step.
        streams: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list]] = {}
        finished_ids: set[str] = set()
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                streams.setdefault(id(target[1]), (*target, []))[2].append(out)
            if out.finished:
                finished_ids.add(out.request_id)
        for rid in finished_ids:
            target = self._streams.get(rid)
            if target is not None and not self.engine.is_unfinished(rid):  # every choice of the request is done
                streams.setdefault(id(target[1]), (*target, []))[2].append(_FINISHED)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for loop, q, items in streams.values():
            deliveries.setdefault(loop, []).extend((q, item) for item in (coalesce(items) if len(items) > 1 else items))
        # Outputs that carry a choice's first tokens: the caller waits until they are sent.
        first = any(out.new_token_ids and len(out.new_token_ids) == len(out.token_ids) for out in outputs)
        taken = threading.Event() if first and deliveries else None
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_put_all, items, taken)
        return taken

    def _finish_stream(self, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, _FINISHED)

    def _fail_all(self, error: Exception) -> None:
        for rid in self.engine.unfinished_request_ids():
            self.engine.abort_request(rid)
            target = self._streams.get(rid)
            if target is not None:
                target[0].call_soon_threadsafe(target[1].put_nowait, RuntimeError(f"engine step failed: {error}"))


def _put_all(items: list[tuple[asyncio.Queue, object]], taken: threading.Event | None = None) -> None:
    for q, item in items:
        q.put_nowait(item)
    if taken is not None:  # after the tasks these items woke have run their step (sent the tokens)
        asyncio.get_running_loop().call_soon(taken.set)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
