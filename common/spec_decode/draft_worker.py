"""The draft model's side of speculative decoding: a small model proposing tokens, no network.

Each speculating sequence keeps its context in the draft's own paged KV cache, so a call only
runs the tokens that are new since the previous one. Life of a sequence (draft.proto's rules):

    propose(reset)  -> committed = context; KV rebuilt from scratch
    propose(update) -> committed += pending[:num_accepted] + token_ids   (rollback folded in)
                       len(committed) != num_context_tokens -> NEEDS_RESET (state dropped)
                       KV truncated to the still-valid prefix, new tokens ingested
                       k proposals -> pending
    release / idle past the lease / pool full (NO_CAPACITY) -> state and blocks freed

KV positions after a call that proposed k tokens d_0..d_{k-1}:

    | committed ............ | d_0 ... d_{k-2} | d_{k-1} |
    |<------- KV written (num_computed) ------>| not fed |

One call is 1 + (k - 1) batched forwards: one over every sequence's new tokens (mixed lengths,
flat layout), then k - 1 single-token steps batched across sequences.

Lookahead (greedy sequences; the draft's own device works while the target verifies). Between
calls, `extend_lookahead()` keeps drafting each greedy sequence past its proposals, betting that
the target accepts them all and that its bonus token is the draft's own next token:

    | committed ... | d_0 ... d_{k-1} | e_0 e_1 ... e_m |      e_*: lookahead (greedy continuation)

If the next update accepts every d and its new tokens continue along e (e_0 == the bonus), the
draft's KV for them is already written and the next proposals are e_1.., taken without a forward
(drafting time hidden behind verification, as in PEARL). Otherwise the lookahead is dropped with
the rejected proposals' KV. Greedy drafts are a function of the context, so proposals are the
same with or without lookahead (up to float rounding between a one-token and a many-token
forward); the target's verification keeps its output exact either way.

Sampled sequences draw from the draft's own processed distribution (temperature, top_k, top_p,
min_p) after it is rounded to the wire dtype, and that exact distribution is returned, so the
verifier's rejection sampling keeps the output distributed as the target's.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import torch

from common.attention.backend import get_attention_backend
from common.engine.model_runner import ModelRunner, SequenceInput
from common.kv_cache.kv_cache_manager import KVCacheManager
from common.kv_cache.paged_cache import PagedKVCache
from common.models.loader import load_model
from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler, SamplingState
from common.spec_decode.proposer import Proposal, ProposalRequest

logger = logging.getLogger(__name__)

_EXP_FLOOR = torch.finfo(torch.float32).tiny
DEFAULT_CPU_KV_CACHE_MEMORY = 256 * 2**20


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 of the folder's tokenizer.json ('' when it has none): same hash, same token ids."""
    path = Path(model_dir) / "tokenizer.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


@dataclass(frozen=True)
class DraftWorkerConfig:
    model: str
    """Hugging Face folder of the draft model (same tokenizer as the target)."""
    dtype: str = "auto"
    weight_dtype: str = "auto"
    """auto (the dtype) or bfloat16: the matrices stored in bf16 under float32 math (EngineConfig)."""
    device: str = "cpu"
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    """Blocks of the draft's KV pool; default: kv_cache_memory worth."""
    kv_cache_memory: int | None = None
    max_num_draft_tokens: int = 16
    """Largest k one sequence may ask for."""
    max_num_seqs: int = 256
    """Most sequences held at once; beyond it new sequences get NO_CAPACITY."""
    lease_s: float = 60.0
    """A sequence not touched for this long is freed (its decode worker may be gone)."""
    seed: int = 0
    """Seed of the draws of sequences that give none."""

    def __post_init__(self) -> None:
        if self.max_num_draft_tokens < 1:
            raise ValueError(f"max_num_draft_tokens must be >= 1, got {self.max_num_draft_tokens}")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {self.lease_s}")


class DraftStatus(Enum):
    OK = "ok"
    NEEDS_RESET = "needs_reset"
    """Unknown sequence or context length mismatch: send reset next time."""
    NO_CAPACITY = "no_capacity"
    """The pool (or the sequence limit) could not hold it: state dropped, retry with reset later."""


@dataclass(frozen=True, slots=True)
class DraftSampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k if self.top_k > 0 else -1,
            top_p=self.top_p if 0.0 < self.top_p < 1.0 else 1.0, min_p=self.min_p, max_tokens=None,
        )  # fmt: skip


SeqKey = tuple[str, int]
"""(request id, choice index)."""


@dataclass(frozen=True, slots=True)
class DraftUpdate:
    """One sequence of one propose call (draft.proto's DraftSequence as a domain value)."""

    request_id: str
    choice_index: int
    reset: bool
    num_accepted: int
    token_ids: list[int]
    num_context_tokens: int
    num_draft_tokens: int
    sampling: DraftSampling = DraftSampling()

    @property
    def key(self) -> SeqKey:
        return (self.request_id, self.choice_index)


@dataclass(slots=True)
class DraftResult:
    status: DraftStatus
    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    """[len(token_ids), vocab] float32 for sampled sequences (None for greedy ones): the draft's
    distribution rounded to the wire dtype, not renormalized; token j was drawn from row j
    divided by its sum, exactly what a receiver computes."""
    num_context_tokens: int = 0


@dataclass(slots=True)
class _DraftSeq:
    committed: list[int]
    """Context confirmed by decode."""
    pending: list[int] = field(default_factory=list)
    """The previous call's proposals, not yet confirmed."""
    lookahead: list[int] = field(default_factory=list)
    """Greedy continuation drafted past `pending` between calls (see the module docstring)."""
    num_computed: int = 0
    """Leading tokens of committed + pending + lookahead whose K/V is in the cache."""
    last_used: float = 0.0
    greedy: bool = True
    """The last call's sampling was greedy (only greedy sequences look ahead)."""
    last_k: int = 0
    """The last call's k: how far lookahead is worth going (k + 1 tokens: the bonus, then k)."""

    @property
    def timeline(self) -> list[int]:
        return self.committed + self.pending + self.lookahead


@dataclass(slots=True)
class _Work:
    """A sequence being served in this call."""

    key: SeqKey
    seq: _DraftSeq
    k: int
    sampling: DraftSampling
    state: SamplingState | None
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    num_reused: int = 0
    """Leading drafts taken from the lookahead (their K/V, but the last one's, is written)."""


class DraftWorker:
    def __init__(self, config: DraftWorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device if config.device != "auto" else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))  # fmt: skip
        attention = get_attention_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(config.model, config.dtype, self.device, attention,
                                                   weight_dtype=config.weight_dtype)  # fmt: skip
        self.dtype = self.model.dtype
        m = self.model_config
        num_blocks = config.num_kv_blocks
        if num_blocks is None:
            per_block = PagedKVCache.bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, config.block_size, self.dtype)
            num_blocks = max(1, (config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY) // per_block)
        self.kv_cache = PagedKVCache(m.num_layers, num_blocks, config.block_size, m.num_kv_heads, m.head_dim,
                                     self.dtype, self.device)  # fmt: skip
        # No prefix caching: blocks are never shared, so truncate() always keeps exactly what it is told.
        self.kv = KVCacheManager(num_blocks, config.block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.model, self.kv_cache.kv_caches, config.block_size, self.device)
        self.sampler = Sampler(self.device, seed=config.seed)
        self.vocab_size = m.vocab_size
        self.max_model_len = m.max_model_len
        self.tokenizer_hash = tokenizer_hash(config.model)
        self.model_id = Path(config.model).name
        self._seqs: dict[SeqKey, _DraftSeq] = {}

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def release(self, keys: list[SeqKey] = (), request_ids: list[str] = ()) -> int:
        """Frees sequences by key and every choice of the given request ids; unknown ones ignored."""
        ids, wanted = set(request_ids), set(keys)
        doomed = [key for key in self._seqs if key in wanted or key[0] in ids]
        for key in doomed:
            self._drop(key)
        return len(doomed)

    def expire_idle(self, now: float | None = None) -> int:
        """Frees sequences idle for longer than the lease; returns how many."""
        now = time.monotonic() if now is None else now
        stale = [key for key, s in self._seqs.items() if now - s.last_used > self.config.lease_s]
        for key in stale:
            logger.info("draft: lease of %s expired, freeing it", key)
            self._drop(key)
        return len(stale)

    def _drop(self, key: SeqKey) -> None:
        self._seqs.pop(key, None)
        self.kv.free(key)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        for key, s in self._seqs.items():
            table = self.kv.block_table(key) if self.kv.has_request(key) else []
            assert s.num_computed <= len(table) * self.kv.block_size, f"{key}: K/V past its blocks"
            assert s.num_computed <= len(s.timeline), f"{key}: K/V past its tokens"
            assert not s.lookahead or s.greedy, f"{key}: a sampled sequence looked ahead"

    # -- propose ----------------------------------------------------------------------------
    def propose(self, updates: list[DraftUpdate], prob_dtype: torch.dtype = torch.float32) -> list[DraftResult]:
        """Syncs every sequence and proposes its tokens; one result per update, in order."""
        now = time.monotonic()
        results: list[DraftResult | None] = [None] * len(updates)
        work: list[tuple[int, _Work]] = []
        for i, u in enumerate(updates):
            status = self._sync(u, now)
            if status is not DraftStatus.OK:
                results[i] = DraftResult(status)
                continue
            seq = self._seqs[u.key]
            k = min(u.num_draft_tokens, self.config.max_num_draft_tokens, self.max_model_len - len(seq.committed))
            seq.greedy, seq.last_k = u.sampling.is_greedy, k
            reused = seq.lookahead[:k] if seq.greedy else []
            seq.lookahead = seq.lookahead[len(reused):] if seq.greedy else []
            if not self.kv.allocate_slots(u.key, max(len(seq.committed) + max(k - 1, 0), seq.num_computed)):
                self._drop(u.key)
                results[i] = DraftResult(DraftStatus.NO_CAPACITY)
                continue
            state = None
            if not u.sampling.is_greedy:
                state = SamplingState(u.sampling.to_params(), (), [])
            work.append((i, _Work(u.key, seq, k, u.sampling, state, drafts=reused, num_reused=len(reused))))
        to_run = [w for _, w in work if w.num_reused < w.k]  # the rest is answered from its lookahead
        if to_run:
            self._run(to_run, prob_dtype)
        for i, w in work:
            w.seq.pending = w.drafts
            probs = torch.stack(w.probs) if w.probs else None
            results[i] = DraftResult(DraftStatus.OK, w.drafts, probs, len(w.seq.committed))
        return results  # type: ignore[return-value]

    def _sync(self, u: DraftUpdate, now: float) -> DraftStatus:
        """Applies the update to the sequence's context and rolls its K/V back to what stays valid."""
        if u.reset:
            self._drop(u.key)
            if len(self._seqs) >= self.config.max_num_seqs:
                return DraftStatus.NO_CAPACITY
            seq = self._seqs[u.key] = _DraftSeq(committed=list(u.token_ids))
        else:
            seq = self._seqs.get(u.key)
            if seq is None:
                return DraftStatus.NEEDS_RESET
            a = min(u.num_accepted, len(seq.pending))
            old_len, timeline, all_accepted = len(seq.committed), seq.timeline, a == len(seq.pending)
            seq.committed += seq.pending[:a] + list(u.token_ids)
            seq.pending = []
            # K/V of accepted proposals stays, and so does that of a lookahead the new tokens
            # continue along; the rest (rejected proposals, a lookahead that lost its bet) is rolled back.
            same = old_len + a
            if all_accepted:
                while same < min(len(seq.committed), len(timeline)) and timeline[same] == seq.committed[same]:
                    same += 1
            on_course = all_accepted and same == len(seq.committed)
            seq.lookahead = timeline[same:] if on_course else []
            if not on_course and same < seq.num_computed:
                seq.num_computed = self.kv.truncate(u.key, same) if self.kv.has_request(u.key) else 0
        seq.last_used = now
        if len(seq.committed) != u.num_context_tokens or not seq.committed:
            self._drop(u.key)
            return DraftStatus.NEEDS_RESET
        if len(seq.committed) > self.max_model_len:
            self._drop(u.key)
            return DraftStatus.NO_CAPACITY
        if seq.num_computed >= len(seq.committed) and not seq.lookahead:
            # Nothing new and nothing drafted ahead: rerun the last token for its logits.
            seq.num_computed = self.kv.truncate(u.key, len(seq.committed) - 1)
        return DraftStatus.OK

    def _run(self, work: list[_Work], prob_dtype: torch.dtype) -> None:
        # 1. Ingest every sequence's new tokens (and the drafts taken from its lookahead) in one
        #    forward; logits only where k > 0.
        batch = [
            SequenceInput(
                token_ids=(w.seq.committed + w.drafts)[w.seq.num_computed :], start_pos=w.seq.num_computed,
                block_table=self.kv.block_table(w.key), num_logits=1 if w.k > 0 else 0,
            )  # fmt: skip
            for w in work
        ]
        logits = self.runner.execute(batch)  # [num sequences with k > 0, vocab]
        for w in work:
            w.seq.num_computed = len(w.seq.committed) + len(w.drafts)
        active = [w for w in work if w.k > 0]
        self._choose(active, logits, prob_dtype)
        while active := [w for w in active if len(w.drafts) < w.k]:
            # 2. One token per still-drafting sequence: feed the previous draft.
            batch = [SequenceInput([w.drafts[-1]], w.seq.num_computed, self.kv.block_table(w.key), 1) for w in active]
            logits = self.runner.execute(batch)
            for w in active:
                w.seq.num_computed += 1
            self._choose(active, logits, prob_dtype)

    def extend_lookahead(self) -> int:
        """One batched draft step past the proposals of every greedy sequence whose lookahead is
        shorter than its next call can use (k + 1); returns how many it extended (0: none wants)."""
        work: list[tuple[SeqKey, _DraftSeq]] = []
        for key, seq in self._seqs.items():
            if not (seq.greedy and seq.pending) or len(seq.lookahead) > seq.last_k:
                continue
            length = len(seq.committed) + len(seq.pending) + len(seq.lookahead)
            # Only a timeline whose last token alone is unfed (as a call leaves it) is extended.
            if seq.num_computed != length - 1 or length >= self.max_model_len:
                continue
            if self.kv.allocate_slots(key, length):  # no room: no lookahead, the sequence stays
                work.append((key, seq))
        if not work:
            return 0
        batch = [SequenceInput([seq.timeline[-1]], seq.num_computed, self.kv.block_table(key), 1) for key, seq in work]
        best = self.runner.execute(batch).argmax(dim=-1).tolist()
        for (_, seq), token in zip(work, best):
            seq.num_computed += 1
            seq.lookahead.append(int(token))
        return len(work)

    def _choose(self, active: list[_Work], logits: torch.Tensor, prob_dtype: torch.dtype) -> None:
        """Appends one draft token per sequence: argmax, or a draw from the rounded distribution."""
        sampled = [i for i, w in enumerate(active) if w.state is not None]
        greedy = [i for i, w in enumerate(active) if w.state is None]
        if greedy:
            best = logits[torch.tensor(greedy, device=logits.device)].argmax(dim=-1).tolist()
            for i, t in zip(greedy, best):
                active[i].drafts.append(int(t))
        if not sampled:
            return
        rows = torch.tensor(sampled, device=logits.device)
        probs = self.sampler.compute_probs(logits[rows], [active[i].state for i in sampled])  # [S, vocab]
        # Round to the wire dtype first, then draw from exactly what the verifier will see.
        rounded = probs.to(prob_dtype).float()  # what goes on the wire
        q = rounded / rounded.sum(dim=-1, keepdim=True)  # what the receiver renormalizes it to
        for row, i in enumerate(sampled):
            w = active[i]
            race = torch.empty_like(q[row]).exponential_(generator=self._generator(w))
            w.drafts.append(int((q[row] / race.clamp_min_(_EXP_FLOOR)).argmax()))
            w.probs.append(rounded[row])

    def _generator(self, w: _Work) -> torch.Generator | None:
        """Seeded draws are keyed by (seed, choice, position): a retried step proposes the same."""
        if w.sampling.seed is None:
            return self.sampler.generator
        position = len(w.seq.committed) + len(w.drafts)
        g = torch.Generator(device=self.device)
        g.manual_seed(hash((w.sampling.seed, w.key[1], position)) % 2**63)
        return g


class DraftWorkerProposer:
    """The engine's Proposer protocol over an in-process DraftWorker (benchmarks, tests).

    Each request is a sequence of its own; what the target accepted is read off the context: the
    longest prefix of the last proposals that the context now continues with.
    """

    keeps_state = True  # a draft model's KV per request (proposer.py)

    def __init__(self, worker: DraftWorker) -> None:
        self.worker = worker
        self._synced: dict[str, tuple[int, list[int]]] = {}  # id -> (committed length, pending)

    def propose(self, requests: list[ProposalRequest]) -> dict[str, Proposal]:
        updates = [sync_update(r.request_id, r.token_ids, self._synced.get(r.request_id), r.k, r.params) for r in requests]
        results = self.worker.propose(updates)
        out: dict[str, Proposal] = {}
        for r, res in zip(requests, results):
            if res.status is not DraftStatus.OK:
                self._synced.pop(r.request_id, None)
                continue
            self._synced[r.request_id] = (len(r.token_ids), res.token_ids)
            if res.token_ids:
                out[r.request_id] = Proposal(res.token_ids, pad_probs(res.probs, r.params, None))
        return out

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._synced.pop(rid, None)
        self.worker.release([(rid, 0) for rid in request_ids])


def sync_update(request_id: str, context: list[int], synced: tuple[int, list[int]] | None, k: int,
                params: SamplingParams, choice_index: int = 0) -> DraftUpdate:  # fmt: skip
    """The update that brings the draft's copy of a sequence to `context`.

    synced = (committed length the draft holds, its pending proposals) after the last OK call, or
    None to reset. Accepted proposals = the longest prefix of pending that the context continues with.
    """
    sampling = DraftSampling(params.temperature, max(params.top_k, 0), params.top_p, params.min_p, params.seed)
    if synced is None or synced[0] > len(context):
        return DraftUpdate(request_id, choice_index, True, 0, list(context), len(context), k, sampling)
    length, pending = synced
    a = 0
    while a < len(pending) and length + a < len(context) and context[length + a] == pending[a]:
        a += 1
    return DraftUpdate(request_id, choice_index, False, a, list(context[length + a :]), len(context), k, sampling)


def pad_probs(probs: torch.Tensor | None, params: SamplingParams, target_vocab: int | None) -> torch.Tensor | None:
    """The draft's q as the verifier wants it: None for greedy; rows renormalized (as the draft
    drew from them) and widened to the target's vocab with zeros (ids the draft lacks have q = 0)."""
    if probs is None or params.is_greedy:
        return None
    q = probs.float() / probs.float().sum(dim=-1, keepdim=True)
    if target_vocab is None or q.shape[1] == target_vocab:
        return q
    out = torch.zeros((q.shape[0], target_vocab), dtype=torch.float32)
    n = min(target_vocab, q.shape[1])
    out[:, :n] = q[:, :n]
    return out
