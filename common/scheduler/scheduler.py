"""Continuous batching with chunked prefill, under a per-step token budget.

Each step the scheduler hands out tokens, not phases: a plan is {request: number of new tokens}.
  1. Running requests first, decodes before unfinished prefills, each in arrival order.
  2. Then waiting requests, first come first served, while budget and `max_num_seqs` allow.
     A prompt longer than the remaining budget gets a chunk now and the rest in later steps,
     so one long prompt never stalls the requests that are decoding.
When the KV pool cannot grow a running request, the most recent arrival is preempted (its blocks
freed, to be recomputed later) until the request fits or is itself the one preempted. The
earliest request therefore always progresses, and admission has already rejected any request
that could not fit the whole pool alone, so this never deadlocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.kv_cache.kv_cache_manager import KVCacheManager
from common.scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens fed this step: token_ids[num_computed : num_computed + n] (+ draft tokens)."""


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Adopts a request whose prompt KV is already in its blocks (pushed by a prefill worker)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Ends a request in any state and gives back every block it holds."""
        assert status.is_finished
        if request.request_id not in self.requests:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request.request_id)
        del self.requests[request.request_id]

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        plan = StepPlan()
        new_tokens: dict[str, int] = {}

        decodes = [r for r in self.running if self._num_pending(r) <= 1]
        prefills = [r for r in self.running if r not in decodes] if len(decodes) < len(self.running) else []
        for request in decodes + prefills:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(self._num_pending(request) + len(_draft_of(request)), budget)
            if request.spec_token_ids:
                # Drafts only ride along within the budget and never cost a preemption.
                keep = max(0, num_new - self._num_pending(request))
                if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                    keep = 0
                if keep < len(request.spec_token_ids):
                    _drop_drafts(request, keep)
                    num_new = self._num_pending(request) + keep
            while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                victim = max(self.running, key=lambda r: r.arrival_time)
                budget += new_tokens.pop(victim.request_id, 0)
                self._preempt(victim)
                plan.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                new_tokens[request.request_id] = num_new
                budget -= num_new

        # New admissions only when nothing had to be preempted: admitting now would thrash.
        skipped: list[Request] = []
        while self.waiting and budget > 0 and not plan.preempted:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if not self._prepare_admission(request):
                skipped.append(self.waiting.popleft())  # n > 1 sibling waiting for the shared prompt
                continue
            num_new = min(self._num_pending(request), budget)
            if not self.kv.allocate_slots(request.request_id, request.num_computed_tokens + num_new):
                self.kv.free(request.request_id)  # drop prefix blocks attached for the lookup
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_tokens[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        # Keep decodes first in the plan: the model runner batches them together.
        for request in self.running:
            n = new_tokens.get(request.request_id)
            if n:
                plan.scheduled.append(ScheduledRequest(request, n))
        plan.scheduled.sort(key=lambda s: s.num_new_tokens > 1 + len(_draft_of(s.request)))
        return plan

    def _num_pending(self, request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _prepare_admission(self, request: Request) -> bool:
        """Attaches cached or shared blocks to a request about to be admitted for the first time
        (or again after preemption). Returns False when it must wait for its sibling."""
        if self.kv.has_request(request.request_id):
            return True
        parent = self.requests.get(request.fork_parent) if request.fork_parent else None
        if parent is not None and parent.status == RequestStatus.RUNNING and self.kv.has_request(parent.request_id):
            if parent.num_computed_tokens < parent.num_prompt_tokens:
                return False
            shared = self.kv.fork(parent.request_id, request.request_id, request.num_prompt_tokens)
            request.num_computed_tokens = shared
        elif parent is not None and parent.status != RequestStatus.RUNNING:
            return False if parent.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) else self._lookup(request)
        else:
            self._lookup(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
        return True

    def _lookup(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position: no prefix-cache shortcut.
        tokens = [] if request.needs_prompt_logprobs else request.token_ids
        request.num_computed_tokens = self.kv.get_computed_prefix(request.request_id, tokens)
        return True

    def _preempt(self, request: Request) -> None:
        _drop_drafts(request, 0)
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)


def _draft_of(request: Request) -> list[int]:
    return request.spec_token_ids


def _drop_drafts(request: Request, keep: int) -> None:
    del request.spec_token_ids[keep:]
    if request.spec_draft_probs is not None:
        request.spec_draft_probs = request.spec_draft_probs[:keep] if keep else None
