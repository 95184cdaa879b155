"""Speculative decoding inside the engine step: ask the proposer, verify in one pass.

    step: _propose() (one batched call) -> drafts ride in the scheduled tokens (k + 1 per request)
          -> one model pass -> _verify(): target distributions of the k + 1 positions, exact
          rejection sampling, KV rollback of rejected positions, adaptive k update
"""

from __future__ import annotations

import logging
import time

import torch

from common.engine.outputs import CompletionOutput
from common.engine.sequence import EngineSequence
from common.scheduler.request import Request
from common.spec_decode.adaptive import PRIOR_RATE, PROBE_EVERY, AdaptiveK, expected_tokens
from common.spec_decode.goodput import GoodputGovernor
from common.spec_decode.proposer import ProposalRequest
from common.spec_decode.rejection import verify

logger = logging.getLogger(__name__)

LAPSED = -2
"""Request.spec_proposed_at of a request whose drafting lapsed for good (stateful proposers)."""
SLOWDOWN_MARGIN = 0.95
"""Least fraction of its plain rate a drafting step may deliver a request that does not draft in it (_fair_cap)."""
DRAFTER_MARGIN = 1.0
"""Least fraction of its plain rate a drafting step may deliver a request that drafts in it (_fair_cap)."""


def _top(logprobs: torch.Tensor, n: int | None) -> list[tuple[int, float]] | None:
    if n is None:
        return None
    if n == 0:
        return []
    vals, ids = logprobs.topk(n)
    return list(zip(ids.tolist(), vals.tolist()))


class SpeculationMixin:
    """LLMEngine's speculative-decoding steps (uses its scheduler, kv, sampler and proposer)."""

    def _propose(self) -> None:
        """Asks the proposer, once for the whole batch, for draft tokens of decoding requests."""
        spec = self.config.speculative
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        if not any(r.spec_enabled and r.spec_proposed_at != LAPSED for r in decoding):
            return  # nothing to draft for: not a decision for the cost model nor the governors
        cost = None  # None: AdaptiveK's prior
        governor = self.spec_governors.for_batch(len(decoding))
        if spec.adaptive:
            if self.spec_cost.should_explore():
                return  # a plain step, so the cost model sees a second step size
            if not governor.allow():
                return  # drafting steps deliver fewer tokens/s than plain ones here (goodput.py)
            cost = self.spec_cost.draft_token_cost(len(decoding))
        self.spec_steps += 1
        # A governor's burst explores: new requests start at k >= 1, as in a probe, and their
        # start is judged as if the workload were new (_starts_worth), not by what earlier
        # requests measured: that is the stale measurement the burst is there to refresh.
        exploring = spec.adaptive and governor.exploring
        probe = exploring or self.spec_steps % PROBE_EVERY == 0  # every k = 0 request probes in this same step
        wanted: list[ProposalRequest] = []
        starts: list[tuple[Request, ProposalRequest]] = []  # first proposals of a stateful draft
        lapsed: list[str] = []
        stateful = spec.adaptive and getattr(self.proposer, "keeps_state", False)
        catch_up = False  # some wanted request's draft has tokens to ingest first (below)
        for req in decoding:
            if not req.spec_enabled or req.spec_proposed_at == LAPSED:
                continue
            behind = req.spec_proposed_at < self.num_steps - 1  # not drafted in the last step
            if stateful and behind and req.spec_proposed_at >= 0:
                # Not drafted for two steps or more (k = 0, or the governor stopped drafting):
                # drafting now would make the draft ingest every token since, at a prefill's
                # cost, more than a probe can win back. The request goes on plain and its draft
                # state is freed; new requests probe. A request that never drafted stays a
                # start, however old: _starts_worth prices its whole context's ingestion against
                # its remaining tokens (while the prices are unmeasured, one starts a step, and
                # the others must not age out meanwhile: at batch 4 two of four never drafted).
                lapsed.append(req.request_id)
                req.spec_proposed_at = LAPSED
                continue
            if req.adaptive_k is None:
                req.adaptive_k = AdaptiveK(spec.num_speculative_tokens, rate=self.spec_prior.rate)
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            k = min(req.adaptive_k.next_k(cost, probe) if spec.adaptive else spec.num_speculative_tokens, room)
            if k <= 0:
                continue
            proposal = ProposalRequest(req.request_id, req.token_ids, req.num_tokens, k, req.params)
            if stateful and req.spec_proposed_at < 0:
                starts.append((req, proposal))  # its draft ingests its prompt first: decided below
                continue
            wanted.append(proposal)
            catch_up = catch_up or behind
        if lapsed:
            logger.debug("drafting lapsed for %d of %d decoding requests at step %d", len(lapsed), len(decoding), self.num_steps)
            self.proposer.release(lapsed)
        predicted = self._predicted_value(cost) if cost is not None and (starts or wanted) else None
        offered = {w.request_id for _, w in starts}
        if starts:
            starts = starts[: self._starts_worth(starts, len(decoding), cost, predicted, governor, exploring)]
            wanted += [w for _, w in starts]
            catch_up = catch_up or bool(starts)
        if not wanted:
            return
        if spec.adaptive:
            cap = self._fair_cap(decoding, wanted, offered)
            if cap == 0:
                return  # a plain step: any drafting would cost some request more than it gains it
            for w in wanted:
                w.k = min(w.k, cap)
        # The draft ingests every token it has not seen before it drafts: a new request's prompt,
        # or, on a resume (last drafted more than a step ago; stateless proposers only), every
        # token since. That is a one-off per request, a draft prefill on a CPU, not the price of
        # one more draft token nor the rate of drafting: such calls stay out of both (the first
        # sample of a moving average would otherwise be its slowest step), and a new prompt's
        # ingestion is priced on its own, for _starts_worth.
        self.spec_catch_up = catch_up
        self.spec_predicted = predicted
        requests = self.scheduler.requests
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose(wanted)
        except Exception:  # a failed proposer costs this step's speculation, nothing else
            logger.warning("proposer failed; decoding without speculation this step", exc_info=True)
            return
        seconds = time.perf_counter() - started
        positions = max(w.k for w in wanted)
        if not self.spec_catch_up:
            self.spec_cost.observe_proposal(len(wanted), positions, seconds)
        elif starts:
            self.spec_cost.observe_catch_up(sum(len(w.token_ids) for _, w in starts), len(wanted), positions, seconds)
        for w in wanted:
            p = proposals.get(w.request_id)
            if p is None or not p.token_ids:
                continue
            req = requests[w.request_id]
            req.spec_proposed_at = self.num_steps + 1  # the step about to run verifies them
            req.spec_token_ids = list(p.token_ids[: w.k])
            req.spec_draft_probs = None if p.probs is None else p.probs[: len(req.spec_token_ids)].float()

    def _fair_cap(self, decoding: list[Request], wanted: list[ProposalRequest], waiting: set[str]) -> int:
        """The most draft tokens any request may draft this step so that no decoding request is
        expected to get fewer tokens per second than a plain step would give it (within
        SLOWDOWN_MARGIN); 0: none, decode plain. A drafting step takes longer for the whole
        batch (the draft's positions, the wider verification), and a request that drafts little,
        at a low acceptance, or not at all (k = 0, lapsed, speculation off) gains at most its
        few tokens per step: at batch 4 on a CPU a drafting step of k = 4 took ~2.3x a plain
        one, so a chat request accepting 0.27 of its drafts ran at half its plain rate beside
        three that accepted 0.8, finished last, and made the batch 0.85x. A smaller k for all
        shortens the step, so the cap is the largest k that leaves no one behind: speculation
        here never buys throughput with one request's latency. (Drafting requests lapse after
        two plain steps: a request that stays behind ends drafting for the batch.) A request that
        drafts must be expected to gain (DRAFTER_MARGIN): its drafting costs the batch, so it
        draws no allowance; one that does not draft (speculation off, k = 0) may lose up to
        SLOWDOWN_MARGIN, or a single plain request would end drafting for everyone. In a batch
        that drafts as one, as a wave of four chat requests, the margin was where the wave
        landed: at 0.95 it finished at 0.93-1.01x its plain time across runs."""
        ks = [w.k for w in wanted]
        top = max(ks, default=0)
        if len(decoding) < 2 or top == 0:
            return top  # a batch of one: AdaptiveK's own value already decides
        by_id = {w.request_id: w.k for w in wanted}
        members = []  # (acceptance rate, k wanted) of every request a drafting step would slow
        for req in decoding:
            if req.max_tokens - req.num_output_tokens <= 1:
                continue  # finishing with this step either way
            if req.request_id in waiting and req.request_id not in by_id:
                continue  # offered a start it did not take this step: judged again the next
            # Its acceptance over all its drafts (not the EMA k follows): ending drafting for
            # the batch is not taken back, so a dip of two rejected drafts must not decide it.
            rate = req.adaptive_k.evidence_rate() if req.adaptive_k is not None else self.spec_prior.rate
            members.append((rate, by_id.get(req.request_id, 0)))
        worst = None
        for cap in range(top, 0, -1):
            ratio = self.spec_cost.step_ratio(len(decoding), [min(k, cap) for k in ks])
            if ratio is None:
                return top  # unmeasured
            # Each member's expected rate over its plain rate, against the margin it is held to.
            shortfalls = [expected_tokens(rate, min(k, cap)) / ratio / (DRAFTER_MARGIN if k else SLOWDOWN_MARGIN)
                          for rate, k in members]  # fmt: skip
            worst = min(shortfalls, default=1.0)
            if worst >= 1.0:
                return cap
        logger.debug("plain step: drafting for %d of %d would leave one at %.2f of its margin", len(wanted),
                     len(decoding), worst)  # fmt: skip
        return 0

    def _predicted_value(self, cost: float, rate: float | None = None) -> float:
        """The cost model's expected tokens/s of a drafting step over a plain one, every sequence
        drafting at acceptance `rate` (None: the engine's recent rate) and the measured price
        `cost` of a draft token (1.0 when drafting would not pay)."""
        rate = self.spec_prior.rate if rate is None else rate
        return AdaptiveK(self.config.speculative.num_speculative_tokens, rate=rate).best(cost)[1]

    def _starts_worth(self, starts: list[tuple[Request, ProposalRequest]], batch: int, cost: float | None,
                      predicted: float | None, governor: GoodputGovernor, exploring: bool = False) -> int:  # fmt: skip
        """How many new requests start drafting this step. A start makes a stateful draft ingest
        the request's prompt (a prefill at the draft, seconds for a batch on a CPU), and a draft
        call costs about the same for one sequence as for several (one batched step per
        position), so drafting for one of a batch cannot show what drafting for all would
        deliver. Once the prices are measured, all start together, or none: together when the
        time drafting is expected to save over their remaining tokens (every sequence drafting,
        at the engine's recent acceptance rate and the measured prices, corrected by what
        drafting steps here delivered against their predictions) exceeds what the draft is
        expected to take to ingest their prompts. That holds even where drafting is known to
        pay: the governor measures drafting's rate, not its start-up (a batch of four short
        requests may never win back four prompts' ingestion). Until the prices are measured,
        all start where drafting pays, else one a step, which measures them cheaply. While the
        governor explores (a burst is due: its measurement went stale), the value is the one a new
        workload would have, at the engine's recent acceptance or PRIOR_RATE, whichever is higher,
        uncalibrated: the burst must be able to start what stale numbers refuse, and only what
        could win back its ingestion."""
        share = self.spec_cost.step_share(batch)
        ingest = self.spec_cost.ingest_cost(sum(len(w.token_ids) for _, w in starts))
        if cost is None or predicted is None or share is None or ingest is None:
            return len(starts) if governor.drafting_pays else 1
        if exploring:
            value = self._predicted_value(cost, max(self.spec_prior.rate, PRIOR_RATE))
        else:
            value = governor.calibrated(predicted)
        if value <= 1.0:
            logger.debug("no drafting starts for %d new requests of %d: value %.2f", len(starts), batch, value)
            return 0
        remaining = sum(req.max_tokens - req.num_output_tokens - 1 for req, _ in starts)
        saving = remaining * share * (1.0 - 1.0 / value)
        logger.debug("drafting starts for %d new requests of %d: %s (expected saving %.2f s, ingestion %.2f s, value %.2f)",
                     len(starts), batch, saving > ingest, saving, ingest, value)  # fmt: skip
        return len(starts) if saving > ingest else 0

    def _set_step_threads(self) -> None:
        """Fewer torch threads while drafts are in flight (the draft worker has the other core),
        the engine's own count otherwise (SpeculativeConfig.threads_while_drafting)."""
        while_drafting = self.config.speculative.threads_while_drafting
        if while_drafting is None:
            return
        if self.plain_threads is None:
            self.plain_threads = torch.get_num_threads()
        drafting = any(r.spec_token_ids for r in self.scheduler.running)
        wanted = while_drafting if drafting else self.plain_threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def _verify(self, drafted: list[tuple[EngineSequence, int, list[int]]], logits: torch.Tensor) -> list[CompletionOutput]:
        """Scores each request's drafts against the target's k + 1 distributions (one pass)."""
        rows = torch.tensor([r + j for _, r, d in drafted for j in range(len(d) + 1)], device=logits.device)
        states = [seq.state.with_draft(d[:j]) for seq, _, d in drafted for j in range(len(d) + 1)]
        probs = self.sampler.compute_probs(logits[rows], states, self.eos_token_ids)
        raw_logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        outputs = []
        offset = 0
        for seq, _, drafts in drafted:
            req = seq.request
            n = len(drafts) + 1
            result = verify(
                drafts, probs[offset : offset + n], req.spec_draft_probs, req.params.is_greedy,
                seq.state.generator or self.sampler.generator,
            )  # fmt: skip
            lps = raw_logprobs[offset : offset + n]
            offset += n
            self.spec_stats.record(len(drafts), result.num_accepted)
            req.adaptive_k.update(len(drafts), result.num_accepted)
            self.spec_prior.update(len(drafts), result.num_accepted)
            req.spec_token_ids = []
            req.spec_draft_probs = None
            # K/V is valid for the last real token and the accepted drafts; roll back the rest.
            req.num_computed_tokens = self.kv.truncate(req.request_id, req.num_computed_tokens + 1 + result.num_accepted)
            self.kv.cache_full_blocks(req.request_id, req.token_ids + drafts, req.num_computed_tokens)
            token_logprobs = [(float(lps[j, t]), _top(lps[j], req.params.logprobs)) for j, t in enumerate(result.token_ids)]
            outputs.append(self._append_tokens(seq, result.token_ids, token_logprobs))
        return outputs
