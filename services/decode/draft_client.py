"""Decode's side of the draft service: the engine's Proposer over gRPC (draft.proto).

Per engine step, for every speculating request at once:

    propose(requests) ── one Propose call, deadline --draft-timeout-ms ──> draft worker
         │  per sequence: reset (first call / after any doubt) or
         │                (num_accepted read off the context, the tokens since, k)
         v
    proposals (+ q for sampled requests)      any error or timeout: {} = no speculation this
                                               step; the batch's sequences reset next time, and
                                               the draft is retried after a backoff

Sync calls on the engine thread: the step waits for its proposals anyway. Releases are
batched: finished/aborted ids are collected and sent in one Release by a small flusher thread,
so the engine never blocks on them (the draft's lease frees anything a lost Release leaves).
A failed Propose drops the stub used for proposing, but not the channel releases go to: the
draft still holds the sequences of the requests that finish meanwhile, and the sequences of the
failed call are released too (the draft frees them itself when the call's deadline passed).

The draft is found in the registry (role=draft), or pinned by address. Before the first use of
an address decode checks GetInfo: a draft with another tokenizer or a larger vocabulary is
refused with a clear log, and decode runs without speculation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanContext, SpanKind

from common.spec_decode.draft_worker import pad_probs, sync_update, tokenizer_hash
from common.spec_decode.proposer import Proposal, ProposalRequest
from services.runtime.draft_wire import probs_from_proto
from services.runtime import tracing
from services.runtime.tls import PLAINTEXT, Dialer
from tandem.v1 import draft_pb2, draft_pb2_grpc

logger = logging.getLogger(__name__)

INFO_TIMEOUT_S = 1.0
RELEASE_TIMEOUT_S = 1.0
RELEASE_COALESCE_S = 0.02
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class DraftTargetInfo:
    """What the draft must agree with: the target's tokenizer and vocabulary."""

    tokenizer_hash: str
    vocab_size: int

    @classmethod
    def of_model(cls, model_dir: str, vocab_size: int) -> DraftTargetInfo:
        return cls(tokenizer_hash(model_dir), vocab_size)


class DraftRefused(Exception):
    """GetInfo showed a draft decode must not use (tokenizer or vocabulary mismatch)."""


def propose_span(requests: list[ProposalRequest], active: Mapping[str, SpanContext]) -> Span:
    """One CLIENT span per batched Propose call (engine thread, only when tracing is on): a child
    of the batch's first traced request, so a lone request's trace holds it, with a link to every
    traced request in the batch."""
    if not tracing.enabled() or not active:
        return tracing.INVALID_SPAN
    contexts: list[SpanContext] = []
    for r in requests:
        sc = active.get(r.request_id) or active.get(r.request_id.rpartition("#")[0])  # n > 1: "id#i"
        if sc is not None and sc not in contexts:
            contexts.append(sc)
    if not contexts:
        return tracing.INVALID_SPAN
    parent = tracing.context_from_span_context(contexts[0])
    return tracing.start_span("draft.propose", parent, kind=SpanKind.CLIENT,
                              links=[tracing.Link(sc) for sc in contexts])


class RemoteDraftProposer:
    keeps_state = True  # a draft model's KV per request (proposer.py)

    def __init__(self, target: DraftTargetInfo, timeout_s: float, *, address: str | None = None,
                 discover: Callable[[], list[str]] | None = None, prob_dtype: int = draft_pb2.PROB_DTYPE_FLOAT16,
                 on_close: Callable[[], None] | None = None, dialer: Dialer = PLAINTEXT) -> None:  # fmt: skip
        """`address` pins the draft worker; otherwise `discover()` lists candidate addresses
        (the registry's draft workers, best first)."""
        self.target = target
        self.timeout_s = timeout_s
        self.fixed_address = address
        self.discover = discover or (lambda: [])
        self.prob_dtype = prob_dtype
        self._on_close = on_close
        self.dialer = dialer
        self._channel: grpc.Channel | None = None
        self._stub: draft_pb2_grpc.DraftStub | None = None
        self._release_stub: draft_pb2_grpc.DraftStub | None = None
        """The last connected draft's stub: kept after a failure, so Releases still reach it."""
        self.address: str | None = None
        self._refused: set[str] = set()
        self._synced: dict[str, tuple[int, list[int]]] = {}  # id -> (committed length, pending)
        self._retry_at = 0.0
        self._backoff = MIN_BACKOFF_S
        self.trace_links: Mapping[str, SpanContext] = {}
        """request id -> its traced Generate span (set by the decode server when tracing is on)."""
        self.num_calls = 0
        self.num_failures = 0
        self._step = 0
        # Release batching: ids to free, flushed by the flusher thread.
        self._lock = threading.Lock()
        self._to_release: list[str] = []
        self._wake = threading.Event()
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name="draft-release", daemon=True)
        self._flusher.start()

    # -- Proposer protocol (engine thread) --------------------------------------------------
    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        if time.monotonic() < self._retry_at or not self._connect():
            return {}
        self._step += 1
        msg = draft_pb2.ProposeRequest(prob_dtype=self.prob_dtype, step=self._step)
        for r in requests:
            u = sync_update(r.request_id, r.token_ids, self._synced.get(r.request_id), r.k, r.params)
            seq = msg.sequences.add(request_id=u.request_id, choice_index=0, reset=u.reset, num_accepted=u.num_accepted,
                                    token_ids=u.token_ids, num_context_tokens=u.num_context_tokens,
                                    num_draft_tokens=u.num_draft_tokens)  # fmt: skip
            s = u.sampling
            seq.sampling.CopyFrom(draft_pb2.DraftSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                                                          min_p=s.min_p))  # fmt: skip
            if s.seed is not None:
                seq.sampling.seed = s.seed
        self.num_calls += 1
        span = propose_span(requests, self.trace_links)  # the shared no-op span when tracing is off
        try:
            replies = list(self._stub.Propose(msg, timeout=self.timeout_s,
                                              metadata=tracing.grpc_metadata(tracing.context_of(span))))
        except grpc.RpcError as e:
            tracing.mark_error(span, f"{e.code().name} {e.details()}")
            span.end()
            self._failed(requests, f"Propose: {e.code().name} {e.details()}")
            return {}
        if span.is_recording():
            tracing.set_attributes(span, {"tandem.draft.address": self.address, "tandem.num_sequences": len(requests),
                                          "tandem.num_draft_tokens": sum(len(r.draft_token_ids) for r in replies)})
        span.end()
        self._backoff = MIN_BACKOFF_S
        out: dict[str, Proposal] = {}
        by_id = {r.request_id: r for r in requests}
        for reply in replies:
            r = by_id.get(reply.request_id)
            if r is None:
                continue
            if reply.status != draft_pb2.PROPOSAL_STATUS_OK:
                self._synced.pop(r.request_id, None)  # NEEDS_RESET / NO_CAPACITY: reset next time
                continue
            self._synced[r.request_id] = (len(r.token_ids), list(reply.draft_token_ids))
            tokens = [t for t in reply.draft_token_ids]
            if not tokens or max(tokens) >= self.target.vocab_size:
                continue
            probs = probs_from_proto(reply.probs) if reply.HasField("probs") else None
            if probs is None and not r.params.is_greedy:
                continue  # a sampled request needs q to verify exactly
            out[r.request_id] = Proposal(tokens, pad_probs(probs, r.params, self.target.vocab_size))
        return out

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._synced.pop(rid, None)
        if self._release_stub is None:
            return  # never connected: no draft holds anything of ours
        with self._lock:
            self._to_release.extend(request_ids)
        self._wake.set()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._flusher.join(2.0)
        if self._channel is not None:
            self._channel.close()
        if self._on_close is not None:
            self._on_close()

    # -- connection -------------------------------------------------------------------------
    def _connect(self) -> bool:
        """A checked stub, or False (and a backoff) when no acceptable draft is reachable."""
        if self._stub is not None:
            return True
        candidates = [self.fixed_address] if self.fixed_address else self.discover()
        if not candidates:
            # Nobody registered (yet): looking again is a local read, so no growing backoff.
            self._retry_at = time.monotonic() + MIN_BACKOFF_S
            return False
        for address in candidates:
            if address in self._refused:
                continue
            channel = self.dialer.channel(address, "draft")
            stub = draft_pb2_grpc.DraftStub(channel)
            try:
                self._check(address, stub.GetInfo(draft_pb2.DraftInfoRequest(), timeout=INFO_TIMEOUT_S))
            except grpc.RpcError as e:
                logger.info("draft worker %s unreachable (%s); retrying later", address, e.code().name)
                channel.close()
                continue
            except DraftRefused as e:
                logger.error("refusing draft worker %s: %s; decoding without it", address, e)
                self._refused.add(address)
                channel.close()
                continue
            if self._channel is not None and self._channel is not channel:
                self._channel.close()  # the previous draft's: its sequences go by its lease
            self._channel, self._stub, self._release_stub, self.address = channel, stub, stub, address
            self._synced.clear()  # a new connection knows nothing of ours: every sequence resets
            logger.info("speculating with draft worker %s", address)
            return True
        self._schedule_retry()
        return False

    def _check(self, address: str, info: draft_pb2.DraftInfo) -> None:
        if info.tokenizer_hash != self.target.tokenizer_hash:
            raise DraftRefused(f"its tokenizer (hash {info.tokenizer_hash[:12] or 'none'}) differs from the "
                               f"target's ({self.target.tokenizer_hash[:12] or 'none'})")  # fmt: skip
        if info.vocab_size > self.target.vocab_size:
            raise DraftRefused(f"its vocabulary ({info.vocab_size}) is larger than the target's ({self.target.vocab_size})")

    def _failed(self, requests: list[ProposalRequest], why: str) -> None:
        """The draft may or may not have applied the call: every sequence in it resets next time."""
        self.num_failures += 1
        for r in requests:
            self._synced.pop(r.request_id, None)
        self.release([r.request_id for r in requests])  # they reset next time; free what the draft kept
        logger.warning("draft worker %s: %s; no speculation for %.1f s", self.address, why, self._backoff)
        if self.fixed_address is None and self._channel is not None:
            self._stub = None  # rediscover: the registry may know another draft worker by then
        self._schedule_retry()

    def _schedule_retry(self) -> None:
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    # -- release flusher --------------------------------------------------------------------
    def _flush_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            time.sleep(RELEASE_COALESCE_S)  # gather the step's other finishes into the same call
            self._wake.clear()
            with self._lock:
                ids, self._to_release = self._to_release, []
            stub = self._release_stub
            if ids and stub is not None:
                try:
                    stub.Release(draft_pb2.ReleaseRequest(request_ids=ids), timeout=RELEASE_TIMEOUT_S)
                except grpc.RpcError as e:  # the draft's lease frees them
                    logger.debug("draft Release failed (%s); its lease will free them", e.code().name)
