"""One request's way through the cluster (docs/cluster.md), from the gateway's side.

    route:    decode = pick_decode(registry view, prompt block hashes)      (prefix affinity)
              REMOTE: Decode.ReserveAndHold -> NO_CAPACITY: next worker -> all full: admission queue
                      (the reservation is held by that open call until decode's Generate claims it:
                      if this process dies first, decode sees the call cancelled and frees it)
              LOCAL (aggregated mode, no prefill worker, n > 1, a migration): no reservation
    stream:   Decode.Generate(kv_source) ─┐
              Prefill.Prefill(chunks)  ───┼─▶ one event queue ─▶ ChoiceStream per choice ─▶ updates
              Abort(request_id)        ───┘   (prefill's first tokens may arrive before decode's;
                                               output_index dedupes them)
    end:      every choice finished -> usage; a stop string ended it early -> Decode.Abort
    failure:  prefill fails or decode is unreachable before any token -> retry (LOCAL / next worker)
    too long: a prompt no prefill worker's whole KV cache holds goes LOCAL from the start
    migrate:  decode dies or stalls (no token for --stall-timeout and no SERVING health answer)
              after tokens were sent -> the same retry, LOCAL on another worker, from the prompt
              plus the tokens sent (n > 1: one stream per open choice, each from its own tokens;
              at most --migration-limit times; docs/reliability.md)
    cleanup:  any exit that is not a clean finish (disconnect, Abort, timeout, error) cancels both
              streams (and the reservation's hold) and calls Decode.Abort + Prefill.Abort, so
              every service frees the blocks. A gateway killed outright does none of this: its
              connections close, so decode and prefill see every one of its calls cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.kv_cache.prefix_hash import compute_block_hashes
from services.gateway.admission import AdmissionQueue
from services.gateway.choice_stream import ChoiceStream, token_logprob
from services.gateway.errors import (GatewayError, PromptTooLong, RequestTimeout, Unavailable,
                                     from_worker_status, scrub_addresses)
from services.gateway.model import ServedModel
from services.gateway.request_trace import RequestTrace
from services.gateway.request_types import GenerationRequest, GenerationUpdate, Usage, scoped_id
from services.gateway.route_records import RouteRecords
from services.gateway.workers import (DecodeClient, PrefillClient, Reservation, WorkerChannels,
                                      WorkerHealth)
from services.runtime.local_stream import LocalStreamCall
from services.runtime.metrics import ServiceMetrics
from services.runtime import tracing
from services.runtime.registry import EXTRA_MAX_NUM_SEQS, CachedRegistryView, Role, WorkerInfo, local_socket_of
from services.runtime.routing import AffinityCache, PendingAssignments, pick_decode, pick_prefill
from services.runtime.settings import GatewaySettings

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0  # Reserve / Abort: small unary calls
DEFAULT_BLOCK_SIZE = 16
ROUTE_SETTLE_S = 1.0  # at close: how long the last route-record flush may take before the TTL is left to clean up
DEFAULT_MAX_NUM_SEQS = 128  # EngineSettings' --max-num-seqs default


# Decode stream errors that say "this worker failed", not "this request is bad": retried before
# the first token, migrated after it.
_WORKER_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
})
_RETRY_BEFORE_TOKENS = _WORKER_FAILURES | {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


class _Retry(Exception):
    """This attempt failed: route again (with the tokens so far, if any were sent)."""

    def __init__(self, reason: str, *, exclude: str | None = None, force_local: bool = False) -> None:
        super().__init__(reason)
        self.exclude, self.force_local = exclude, force_local


@dataclass
class _Route:
    decode: WorkerInfo
    prefill: WorkerInfo | None = None
    reservation: Reservation | None = None
    waiting: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # admission places held


@dataclass
class _Leg:
    """One Decode.Generate stream of an attempt: the whole request, or after a migration one
    open choice continued alone (its prompt ends with that choice's tokens so far)."""

    internal_id: str
    choices: list[int]  # the leg's choice index -> the request's choice index
    resumed: int = 0  # output tokens the client had before this leg: its output_index offset
    call: Any = None
    ended: bool = False  # decode ended the leg by itself: nothing to abort there


@dataclass
class _Attempt:
    """The streams of one try: one decode worker, its legs, and prefill's stream when remote."""

    internal_id: str
    route: _Route
    events: asyncio.Queue
    decode: DecodeClient
    legs: list[_Leg] = field(default_factory=list)
    prefill: PrefillClient | None = None
    prefill_call: Any = None
    tasks: list[asyncio.Task] = field(default_factory=list)
    prefill_ended: bool = False
    cached_tokens: int | None = None
    trace: RequestTrace | None = None


@dataclass
class _Active:
    events: asyncio.Queue | None = None
    abort_reason: str | None = None
    trace: RequestTrace | None = None
    prompt_logprobs_sent: bool = False


class Orchestrator:
    def __init__(self, settings: GatewaySettings, model: ServedModel, view: CachedRegistryView,
                 channels: WorkerChannels, health: WorkerHealth, metrics: ServiceMetrics,
                 admission: AdmissionQueue) -> None:
        self.settings = settings
        self.model = model
        self.view = view
        self.channels = channels
        self.health = health
        self.metrics = metrics
        self.admission = admission
        self.pending = PendingAssignments()
        self.affinity = AffinityCache()
        self.routes = RouteRecords(view.registry, ttl_s=settings.request_timeout)
        self._active: dict[str, _Active] = {}
        self._cleanups: set[asyncio.Task] = set()
        self.num_running = 0
        self.after_reserve: Callable[[str], Awaitable[None]] | None = None
        """Test hook, awaited with the internal id right after a Reserve reply arrives."""

    # ----------------------------------------------------------------------- public

    def decode_workers(self) -> list[WorkerInfo]:
        return [w for w in self.view.workers(Role.DECODE) if w.model == self.model.name]

    def run_capacity(self) -> int | None:
        """Sequences the decode workers run at once (registry); None when none is registered.
        A worker that does not publish it counts with the engine's default."""
        workers = self.decode_workers()
        if not workers:
            return None
        return sum(int(w.extra.get(EXTRA_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS)) for w in workers)

    async def abort(self, request_id: str, reason: str = "aborted by the client", owner: str = "") -> bool:
        """Aborts the request `owner` started as `request_id` (GenerationRequest.scoped_id)."""
        scoped = scoped_id(owner, request_id)
        active = self._active.get(scoped)
        if active is None:
            # Maybe another gateway replica serves it: its routing record says where it runs.
            return await self._abort_elsewhere(request_id, owner, reason)
        if active.abort_reason is not None:
            return False
        active.abort_reason = reason
        if active.events is not None:
            active.events.put_nowait(("abort", reason))
        return True

    async def generate(self, req: GenerationRequest, *, trace_parent: tracing.Context | None = None,
                       span_name: str = "generate") -> AsyncIterator[GenerationUpdate]:
        """Streams the request's updates; the last one carries usage. Raises GatewayError.
        trace_parent: the client's trace context; span_name: the request span's name."""
        arrival = time.monotonic()
        deadline = arrival + self.settings.request_timeout
        active = _Active(trace=RequestTrace(span_name, trace_parent, req))
        error: BaseException | None = None
        self._active[req.scoped_id] = active
        self.num_running += 1
        self.metrics.running.set(self.num_running)
        streams = [ChoiceStream(i, self.model, req.prompt_token_ids, req.params) for i in range(req.params.n)]
        timing = _Timing(arrival)
        outcome, exclude, force_local = "error", set[str](), False
        migrations = 0
        admitted = contextlib.ExitStack()
        try:
            admitted.enter_context(self.admission.admit(req.params.n, self.run_capacity()))
            while True:
                attempt = await self._start(req, active, exclude, force_local, deadline, streams)
                try:
                    async for update in self._run(req, attempt, streams, active, deadline, migrations):
                        attempt.route.waiting.close()  # it runs: no longer waiting
                        timing.observe(self.metrics, sum(len(c.token_ids) for c in update.choices))
                        active.trace.observe(update)
                        yield update
                    outcome = "aborted" if active.abort_reason else "success"
                    return
                except _Retry as retry:
                    # A choice whose every token arrived (only the worker's finish did not) has
                    # nothing to move: it ends here.
                    done = [s.abort("length") for s in streams if not s.finished and s.num_tokens
                            and s.num_tokens >= req.params.max_tokens]
                    sent = sum(s.num_tokens for s in streams)
                    if all(s.finished for s in streams):
                        yield GenerationUpdate([u for u in done if u], Usage(len(req.prompt_token_ids), sent))
                        outcome = "success"
                        return
                    if any(done):
                        yield GenerationUpdate([u for u in done if u])
                    if sent:
                        migrations += 1
                        self.metrics.migrations.inc()
                    logger.warning("request %s: %s; routing again%s", req.request_id, retry,
                                   f" with the {sent} tokens sent (migration {migrations})" if sent else "")
                    exclude |= {retry.exclude} if retry.exclude else set()
                    force_local = force_local or retry.force_local
                finally:
                    await self._finish_attempt(attempt)
        except GatewayError as e:
            outcome = request_outcome(e)
            e.counted = True  # the edges count the errors raised before a request got here
            error = e
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "aborted"  # the client went away
            raise
        finally:
            admitted.close()
            self._active.pop(req.scoped_id, None)
            self.routes.forget(req.request_id)
            self.num_running -= 1
            self.metrics.running.set(self.num_running)
            self.metrics.requests.labels(outcome=outcome).inc()
            if outcome == "success":
                self.metrics.e2e.observe(time.monotonic() - arrival)
            active.trace.end(outcome, error)

    # ----------------------------------------------------------------------- routing

    async def _start(self, req: GenerationRequest, active: _Active, exclude: set[str], force_local: bool,
                     deadline: float, streams: list[ChoiceStream]) -> _Attempt:
        """Routes and opens one attempt. After a migration (tokens were sent), the attempt runs
        LOCAL, one leg per open choice, each from the prompt plus that choice's tokens."""
        internal_id = f"gw-{uuid.uuid4().hex}"
        trace = active.trace
        legs = _resumed_legs(req, streams, internal_id)
        if legs is not None:
            req = legs[0][0]
            force_local = True
            if len(legs) > 1:  # route them together: the worker takes every open choice
                req = dataclasses.replace(req, params=dataclasses.replace(req.params, n=len(legs)))
        with tracing.span("gateway.route", trace.context) as span:
            route = await self._route(req, internal_id, exclude, force_local, deadline, tracing.context_of(span))
            if span.is_recording():
                tracing.set_attributes(span, _route_attributes(route, internal_id))
        local = local_socket_of(route.decode) if self.settings.local_sockets else None
        decode = DecodeClient(self.channels, route.decode.address, local_socket=local)
        if legs is None:
            legs = [(req, _Leg(internal_id, list(range(req.params.n))))]
        self.routes.record(req.request_id, internal_id, route.decode.address,
                           route.prefill.address if route.reservation is not None and route.prefill else None,
                           owner=req.owner, legs=[leg.internal_id for _, leg in legs])
        attempt = _Attempt(internal_id, route, asyncio.Queue(), decode, [leg for _, leg in legs], trace=trace)
        active.events = attempt.events
        if active.abort_reason is not None:
            attempt.events.put_nowait(("abort", active.abort_reason))
        remote = route.reservation is not None
        for leg_req, leg in legs:
            leg.call = decode.generate(leg.internal_id, leg_req.prompt_token_ids, leg_req.params, remote=remote,
                                       disable_speculative_decoding=req.disable_speculative_decoding,
                                       num_resumed_outputs=leg.resumed, metadata=trace.metadata())
            attempt.tasks.append(asyncio.create_task(self._read_decode(attempt, leg)))
        if remote:
            attempt.prefill = PrefillClient(self.channels, route.prefill.address)
            attempt.prefill_call = attempt.prefill.prefill(
                internal_id, req.prompt_token_ids, req.params, route.reservation, self.settings.prefill_chunk_size,
                metadata=trace.metadata())
            attempt.tasks.append(asyncio.create_task(self._read_prefill(attempt)))
        return attempt

    async def _route(self, req: GenerationRequest, internal_id: str, exclude: set[str], force_local: bool,
                     deadline: float, trace: tracing.Context | None = None) -> _Route:
        prompt = req.prompt_token_ids
        block_size = next(iter(self.health.block_size.values()), DEFAULT_BLOCK_SIZE)
        hashes = compute_block_hashes(prompt, block_size)
        with contextlib.ExitStack() as queued:
            in_queue = False
            while True:
                registered = self.decode_workers()
                workers = [w for w in registered if w.worker_id not in exclude]
                if not workers:
                    raise Unavailable(self._no_worker_message(len(registered)), code="no_decode_worker")
                prefills = self._prefills_for(len(prompt), block_size)
                local = (force_local or self.settings.mode == "aggregated" or req.params.n > 1
                         or not prefills)
                adjusted = self.pending.apply(workers)
                affinity = self.affinity.of(workers)
                tried: set[str] = set()
                while True:
                    worker = pick_decode(adjusted, hashes, affinity, exclude=tried)
                    if worker is None:
                        break
                    tried.add(worker.worker_id)
                    if local:
                        return self._assigned(_Route(worker), len(hashes) + 1)
                    # Claim the worker before awaiting Reserve: requests routed meanwhile must
                    # see this one, or a burst all lands on the same "most free" worker.
                    claim = self.pending.add(worker.worker_id, blocks=len(hashes) + 1)
                    try:
                        reservation = await self._reserve(worker, internal_id, prompt, deadline, trace)
                    except asyncio.CancelledError:
                        # The client left while Reserve was in flight: decode may hold blocks that
                        # no attempt will ever clean up, so abort them now.
                        self.pending.discard(claim)
                        self._abort_in_background(worker.address, internal_id, "gateway: client left during Reserve")
                        raise
                    if reservation is None or reservation.status != "reserved":
                        self.pending.discard(claim)
                    if reservation is None:
                        continue
                    if reservation.status == "reserved":
                        prefill = pick_prefill(prefills)
                        route = _Route(worker, prefill, reservation)
                        if prefill is not None:
                            self.pending.add(prefill.worker_id, tokens=len(prompt))
                        return route
                    if reservation.status == "too_long":
                        raise PromptTooLong(f"the prompt ({len(prompt)} tokens) does not fit: {reservation.message}",
                                            param="prompt", code="context_length_exceeded")
                    logger.info("decode %s: %s (%s)", worker.address, reservation.status, reservation.message)
                if local:  # nobody looks roomy, but decode queues LOCAL requests itself
                    worker = pick_decode(adjusted, hashes, affinity, blocks_needed=0)
                    if worker is not None:  # it waits there: its n sequences count until a token comes
                        route = _Route(worker)
                        route.waiting.enter_context(self.admission.slot(req.params.n))
                        return self._assigned(route, len(hashes) + 1)
                if not in_queue:  # first time every worker is full: join the queue
                    queued.callback(lambda: self.metrics.waiting.set(self.admission.num_waiting))
                    queued.enter_context(self.admission.slot(req.params.n))
                    self.metrics.waiting.set(self.admission.num_waiting)
                    in_queue = True
                if time.monotonic() >= deadline:
                    raise RequestTimeout(f"no decode worker had room within {self.settings.request_timeout:g} s")
                await self.admission.wait_for_capacity()

    async def _reserve(self, worker: WorkerInfo, internal_id: str, prompt: list[int],
                       deadline: float, trace: tracing.Context | None = None) -> Reservation | None:
        timeout = max(0.1, min(RPC_TIMEOUT_S, deadline - time.monotonic()))
        try:
            reservation = await DecodeClient(self.channels, worker.address).reserve(
                internal_id, prompt, timeout, metadata=tracing.grpc_metadata(trace))
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise from_worker_status(code, e.details() or "", worker.address, internal_id) from None
            logger.warning("Reserve on %s failed: %s %s", worker.address, code.name,
                           e.details() if isinstance(e, grpc.aio.AioRpcError) else f"no answer within {timeout:g} s")
            # A timed-out or broken Reserve may still have reserved: free it rather than wait for its lease.
            self._abort_in_background(worker.address, internal_id, f"gateway: Reserve failed ({code.name})")
            return None
        if self.after_reserve is not None:  # test hook: the reply is in, nothing owns it yet
            try:
                await self.after_reserve(internal_id)
            except BaseException:
                reservation.release()
                raise
        self.health.mark_ok(worker.address)
        return reservation

    def _prefills_for(self, prompt_len: int, block_size: int) -> list[WorkerInfo]:
        """The prefill workers whose whole KV cache holds the prompt (+ the first token), from the
        registry. None of them: the request runs LOCAL, decode computes the prompt (it fits
        decode's cache: limits.fit_to_capacity checked that)."""
        return [w for w in self.view.workers(Role.PREFILL) if w.model == self.model.name
                and (not w.kv_blocks_total or w.kv_blocks_total * block_size > prompt_len)]

    def _assigned(self, route: _Route, blocks: int) -> _Route:
        self.pending.add(route.decode.worker_id, blocks=blocks)
        if route.prefill is not None:
            self.pending.add(route.prefill.worker_id, tokens=0)
        return route

    def _no_worker_message(self, registered: int = 0) -> str:
        snap = self.view.snapshot()
        why = f"; the registry is unreachable ({snap.error})" if snap.error and snap.fetched_at is None else ""
        if snap.error and snap.fetched_at is not None:
            why = f"; the registry is unreachable since {snap.age_s():.0f} s ({snap.error})"
        elif registered:  # every one of them already failed this request (see the gateway's log)
            why = f"; the {registered} registered already failed this request"
        return scrub_addresses(f"no decode worker is available for model {self.model.name!r}{why}")

    # ----------------------------------------------------------------------- streaming

    async def _read_decode(self, attempt: _Attempt, leg: _Leg) -> None:
        try:
            async for message in DecodeClient.messages(leg.call):
                attempt.events.put_nowait(("decode", (leg, message)))
            attempt.events.put_nowait(("decode_end", leg))
        except grpc.aio.AioRpcError as e:
            # CANCELLED too: the server cancels streams when it stops; when we cancel, this task
            # is cancelled first and nobody reads the queue any more.
            attempt.events.put_nowait(("decode_error", (leg, e)))
        except asyncio.CancelledError:
            pass

    async def _read_prefill(self, attempt: _Attempt) -> None:
        try:
            done = await PrefillClient.wait_done(attempt.prefill_call)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                attempt.events.put_nowait(("prefill_error", f"{e.code().name}: {e.details()}"))
            return
        except asyncio.CancelledError:
            return
        if done is None:
            attempt.events.put_nowait(("prefill_error", "the prefill stream ended without a result"))
        else:
            attempt.events.put_nowait(("prefill_done", done))

    async def _next_event(self, attempt: _Attempt, streams: list[ChoiceStream], deadline: float,
                          migrations: int) -> tuple[str, Any]:
        """The attempt's next event. Every --stall-timeout without one, decode's health is
        asked: a worker that does not answer SERVING within --stall-probe-timeout (frozen, hung
        engine, gone) has stalled. An event that arrives while it is asked ends the check."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeout(f"the request took longer than {self.settings.request_timeout:g} s",
                                     code="request_timeout")
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation (a
                # client leaving) that races with an arriving event, and the request runs on.
                async with asyncio.timeout(min(remaining, self.settings.stall_timeout)):
                    return await attempt.events.get()
            except TimeoutError:
                pass
            if time.monotonic() >= deadline:
                continue
            event, serving = await self._event_or_health(attempt, min(remaining, self.settings.stall_probe_timeout))
            if event is not None:
                return event
            if serving:
                continue  # alive, just slow or queued: keep waiting
            self.metrics.stalls.inc()
            reason = (f"decode {attempt.decode.address} sent nothing for {self.settings.stall_timeout:g} s "
                      f"and gave no SERVING health answer in {self.settings.stall_probe_timeout:g} s")
            self._check_migration(streams, migrations, reason)
            raise _Retry(reason, exclude=attempt.route.decode.worker_id, force_local=True)

    @staticmethod
    async def _event_or_health(attempt: _Attempt, timeout_s: float) -> tuple[tuple[str, Any] | None, bool]:
        """Asks decode's health while still waiting for the attempt's next event: (the event, _)
        if one came first, else (None, whether decode answered SERVING within timeout_s)."""
        probe = asyncio.ensure_future(attempt.decode.is_serving(timeout_s=timeout_s))
        getter = asyncio.ensure_future(attempt.events.get())
        try:
            await asyncio.wait({probe, getter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A cancelled Queue.get leaves its item in the queue (it is taken only on return),
            # so nothing is lost when the probe wins, or when the client leaves meanwhile.
            for task in (probe, getter):
                if not task.done():
                    task.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result(), True
        return None, probe.result()

    def _check_migration(self, streams: list[ChoiceStream], migrations: int, reason: str) -> None:
        """Raises the error that ends the request when its tokens so far cannot move on."""
        if all(s.num_tokens == 0 for s in streams):
            return  # nothing sent yet: a plain retry
        reason = scrub_addresses(reason)  # the client sees it: no internal addresses
        if migrations >= self.settings.migration_limit:
            raise Unavailable(f"{reason}; not migrated again (--migration-limit "
                              f"{self.settings.migration_limit})", code="decode_failed")

    async def _run(self, req: GenerationRequest, attempt: _Attempt, streams: list[ChoiceStream],
                   active: _Active, deadline: float, migrations: int = 0) -> AsyncIterator[GenerationUpdate]:
        want_logprobs = req.params.logprobs is not None

        def awaiting_prompt_logprobs() -> bool:
            # Remote KV: prefill's last message carries them, and may come after decode finished.
            return (req.params.prompt_logprobs is not None and not active.prompt_logprobs_sent
                    and attempt.prefill_call is not None and not attempt.prefill_ended)

        while not all(s.finished for s in streams) or awaiting_prompt_logprobs():
            kind, payload = await self._next_event(attempt, streams, deadline, migrations)
            updates = []
            prompt_logprobs = None
            leg = None
            if kind in ("decode", "decode_end", "decode_error"):
                leg, payload = payload if kind != "decode_end" else (payload, None)
            if kind in ("decode", "prefill_done") and payload.prompt_logprobs and not active.prompt_logprobs_sent:
                # [: prompt]: a migrated leg's prompt ends with output tokens
                raw_prompt = payload.prompt_logprobs[: len(req.prompt_token_ids)]
                prompt_logprobs = [token_logprob(self.model, raw) for raw in raw_prompt]
                active.prompt_logprobs_sent = True
            if kind == "decode":
                self.health.mark_ok(attempt.decode.address)
                for d in payload.choices:
                    if 0 <= d.index < len(leg.choices):
                        updates.append(streams[leg.choices[d.index]].add(
                            d.output_index + leg.resumed, d.token_ids, d.logprobs, d.finish_reason, d.stop_token_id))
                if payload.cached_tokens is not None:
                    attempt.cached_tokens = payload.cached_tokens
                if all(streams[i].ended_by_worker for i in leg.choices):
                    leg.ended = True  # nothing left to abort on decode
            elif kind == "prefill_done":
                attempt.prefill_ended = True
                for i, (token, logprob, top) in enumerate(payload.first_tokens[: len(streams)]):
                    raw = [(token, logprob, top)] if want_logprobs else None
                    updates.append(streams[i].add(0, [token], raw, None, None))
                if attempt.cached_tokens is None:
                    cached = max(payload.num_cached_tokens, attempt.route.reservation.num_cached_tokens)
                    attempt.cached_tokens = cached
            elif kind == "decode_end":
                leg.ended = True
                updates = [streams[i].abort("abort") for i in leg.choices]  # decode ended with choices open
            elif kind == "abort":
                attempt.prefill_ended = True  # stop waiting for prompt logprobs too
                updates = [s.abort("abort") for s in streams]
            elif kind == "decode_error":
                e: grpc.aio.AioRpcError = payload
                leg.ended = True
                # A failed stream may leave a reservation behind (refused before it attached):
                # free it without holding up the retry.
                self._abort_in_background(attempt.decode.address, leg.internal_id, "gateway: decode stream failed")
                untouched = all(s.num_tokens == 0 for s in streams)
                if e.code() in (_RETRY_BEFORE_TOKENS if untouched else _WORKER_FAILURES):
                    reason = f"decode {attempt.decode.address} failed: {e.code().name} {e.details()}"
                    if not untouched:
                        self._check_migration(streams, migrations, reason)
                    raise _Retry(reason, force_local=True, exclude=attempt.route.decode.worker_id
                                 if e.code() in _WORKER_FAILURES else None)  # fmt: skip
                raise from_worker_status(e.code(), e.details() or "", attempt.decode.address, req.request_id)
            elif kind == "prefill_error":
                attempt.prefill_ended = True
                if all(s.num_tokens == 0 for s in streams):
                    raise _Retry(f"prefill {attempt.prefill.address} failed: {payload}", force_local=True)
                logger.warning("prefill failed after the first token (decode goes on): %s", payload)
            changed = [u for u in updates if u is not None]
            if changed or prompt_logprobs is not None:
                yield GenerationUpdate(changed, prompt_logprobs=prompt_logprobs)
        cached = attempt.cached_tokens
        if cached is None and attempt.route.reservation is not None:
            cached = attempt.route.reservation.num_cached_tokens
        # A one-token prompt has no prompt logprobs: say so with an empty list.
        missing = req.params.prompt_logprobs is not None and not active.prompt_logprobs_sent
        yield GenerationUpdate([], Usage(len(req.prompt_token_ids), sum(s.num_tokens for s in streams), cached or 0),
                               prompt_logprobs=[] if missing else None)

    async def _finish_attempt(self, attempt: _Attempt) -> None:
        """Frees what the attempt holds on every worker unless decode already ended the request."""
        task = asyncio.create_task(self._cleanup(attempt))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)
        await asyncio.shield(task)  # a cancelled caller must not cancel the aborts

    async def _cleanup(self, attempt: _Attempt) -> None:
        attempt.route.waiting.close()
        for t in attempt.tasks:
            t.cancel()
        prefill_open = attempt.prefill_call is not None and not attempt.prefill_call.done()
        for leg in attempt.legs:
            if leg.call is None:
                continue
            if leg.ended and isinstance(leg.call, LocalStreamCall):
                leg.call.release()  # finished on decode: its connection is kept for the next request
            else:
                leg.call.cancel()  # the servers see a cancelled stream as an abort, too
        if attempt.prefill_call is not None:
            attempt.prefill_call.cancel()
        if attempt.route.reservation is not None:
            attempt.route.reservation.release()  # decode closed it already if a Generate claimed it
        aborts = []
        metadata = attempt.trace.metadata() if attempt.trace is not None else None
        aborts += [attempt.decode.abort(leg.internal_id, "gateway: request ended", metadata=metadata)
                   for leg in attempt.legs if not leg.ended]
        if attempt.prefill is not None and prefill_open:
            aborts.append(attempt.prefill.abort(attempt.internal_id, "gateway: request ended", metadata=metadata))
        for result in await asyncio.gather(*aborts, return_exceptions=True):
            if isinstance(result, Exception):
                logger.warning("abort of %s failed: %s", attempt.internal_id, result)
        self.admission.notify_freed()

    def _abort_in_background(self, address: str, internal_id: str, reason: str) -> None:
        """Decode.Abort that outlives a cancelled caller (like _finish_attempt's cleanup)."""
        async def abort() -> None:
            try:
                await DecodeClient(self.channels, address).abort(internal_id, reason)
            except Exception as e:  # noqa: BLE001 - best effort: the lease frees it otherwise
                logger.warning("abort of %s on %s failed: %s", internal_id, address, e)
            self.admission.notify_freed()

        task = asyncio.create_task(abort())
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort_elsewhere(self, request_id: str, owner: str, reason: str) -> bool:
        route = await self.routes.lookup(request_id)
        if route is None or route.get("owner", "") != owner:
            return False  # unknown, or someone else's
        internal_id = route["internal_id"]
        decode = DecodeClient(self.channels, route["decode"])
        calls = [decode.abort(leg, reason) for leg in route.get("legs") or [internal_id]]
        if route.get("prefill"):
            calls.append(PrefillClient(self.channels, route["prefill"]).abort(internal_id, reason))
        results = await asyncio.gather(*calls, return_exceptions=True)
        return any(r is True for r in results)

    async def close(self) -> None:
        if self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)
        try:  # the last flush of route records (deletes of the requests that just ended), bounded
            async with asyncio.timeout(ROUTE_SETTLE_S):
                await self.routes.settle()
        except TimeoutError:
            logger.debug("route records: %d changes left to their TTL at close", self.routes.pending)


def _resumed_legs(req: GenerationRequest, streams: list[ChoiceStream],
                  internal_id: str) -> list[tuple[GenerationRequest, _Leg]] | None:
    """After a migration (some choice has tokens): one n = 1 request per open choice, its prompt
    the original plus that choice's tokens, with what is left of max_tokens / min_tokens. None
    when nothing was sent (a plain retry). Choice i of a seeded n > 1 request samples with
    seed + i on the engine (LLMEngine.add_request), so its leg carries that seed: decode then
    skips the resumed tokens' draws and the choice continues exactly as it would have."""
    if all(s.num_tokens == 0 for s in streams):
        return None
    params = req.params
    open_streams = [s for s in streams if not s.finished]
    legs = []
    for s in open_streams:
        k = s.num_tokens
        seed = params.seed
        if seed is not None and params.n > 1:
            seed = (seed + s.index + 2**63) % 2**64 - 2**63  # the same generator (mod 2^64), in int64
        leg_params = dataclasses.replace(params, n=1, seed=seed, max_tokens=params.max_tokens - k,
                                         min_tokens=max(0, params.min_tokens - k))
        leg_req = dataclasses.replace(req, prompt_token_ids=req.prompt_token_ids + s.token_ids, params=leg_params)
        leg_id = internal_id if len(open_streams) == 1 else f"{internal_id}-{s.index}"
        legs.append((leg_req, _Leg(leg_id, [s.index], resumed=k)))
    return legs


def request_outcome(error: GatewayError) -> str:
    """tandem_requests_total's outcome label for a failed request."""
    if error.http_status in (429, 503):
        return "rejected"
    if error.http_status == 504:
        return "timeout"
    return "invalid" if 400 <= error.http_status < 500 else "error"


def count_refusal(metrics: ServiceMetrics, error: GatewayError) -> None:
    """Counts a request the edge refused before the orchestrator saw it (a bad body or field)."""
    if not getattr(error, "counted", False):
        error.counted = True
        metrics.requests.labels(outcome=request_outcome(error)).inc()


def _route_attributes(route: _Route, internal_id: str) -> dict[str, object]:
    reservation = route.reservation
    return {
        "tandem.internal_request_id": internal_id,
        "tandem.kv_source": "remote" if reservation is not None else "local",
        "tandem.decode.address": route.decode.address,
        "tandem.prefill.address": route.prefill.address if route.prefill is not None else None,
        "tandem.num_cached_tokens": reservation.num_cached_tokens if reservation is not None else None,
    }


class _Timing:
    """TTFT and inter-token latency of one request, as the client sees them."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.last: float | None = None

    def observe(self, metrics: ServiceMetrics, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        if self.last is None:
            metrics.ttft.observe(now - self.arrival)
        else:
            gap = (now - self.last) / num_tokens
            for _ in range(num_tokens):
                metrics.itl.observe(gap)
        self.last = now
