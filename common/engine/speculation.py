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
from common.spec_decode.adaptive import PROBE_EVERY, AdaptiveK
from common.spec_decode.proposer import ProposalRequest
from common.spec_decode.rejection import verify

logger = logging.getLogger(__name__)

LAPSED = -2
"""Request.spec_proposed_at of a request whose drafting lapsed for good (stateful proposers)."""
YOUNG = 2
"""Output tokens up to which a request that never drafted may still start (stateful proposers)."""


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
        cost = None  # None: AdaptiveK's prior
        governor = self.spec_governors.for_batch(len(decoding))
        if spec.adaptive:
            if self.spec_cost.should_explore():
                return  # a plain step, so the cost model sees a second step size
            if not governor.allow():
                return  # drafting steps deliver fewer tokens/s than plain ones here (goodput.py)
            cost = self.spec_cost.draft_token_cost(len(decoding))
        self.spec_steps += 1
        probe = self.spec_steps % PROBE_EVERY == 0  # every k = 0 request probes in this same step
        wanted: list[ProposalRequest] = []
        lapsed: list[str] = []
        stateful = spec.adaptive and getattr(self.proposer, "keeps_state", False)
        # A request's first proposal makes the draft ingest its prompt. Until drafting is known
        # to pay, one new request a step starts: a probe of a whole large batch would cost a
        # prefill of every prompt in it at the draft (seconds on a CPU) to learn what one tells.
        starts_left = len(decoding) if governor.drafting_pays else 1
        catch_up = False  # some wanted request's draft has tokens to ingest first (below)
        for req in decoding:
            if not req.spec_enabled or req.spec_proposed_at == LAPSED:
                continue
            behind = req.spec_proposed_at < self.num_steps - 1  # not drafted in the last step
            if stateful and behind and (req.spec_proposed_at >= 0 or req.num_output_tokens > YOUNG):
                # Not drafted for two steps or more (k = 0, or the governor stopped drafting), or
                # never drafted past its first steps: drafting now would make the draft ingest
                # every token since, at a prefill's cost, more than a probe can win back. The
                # request goes on plain and its draft state is freed; new requests probe.
                if req.spec_proposed_at >= 0:
                    lapsed.append(req.request_id)
                req.spec_proposed_at = LAPSED
                continue
            if req.adaptive_k is None:
                req.adaptive_k = AdaptiveK(spec.num_speculative_tokens, rate=self.spec_prior.rate)
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            k = min(req.adaptive_k.next_k(cost, probe) if spec.adaptive else spec.num_speculative_tokens, room)
            if k > 0 and stateful and req.spec_proposed_at < 0:
                if starts_left <= 0:
                    continue  # may start in a later step, while it is young
                starts_left -= 1
            if k > 0:
                wanted.append(ProposalRequest(req.request_id, req.token_ids, req.num_tokens, k, req.params))
                catch_up = catch_up or behind
        if lapsed:
            self.proposer.release(lapsed)
        if not wanted:
            return
        # The draft ingests every token it has not seen before it drafts: a new request's prompt,
        # or, on a resume (last drafted more than a step ago; stateless proposers only), every
        # token since. That is a one-off per request, a draft prefill on a CPU, not the price of
        # one more draft token nor the rate of drafting: such calls stay out of both (the first
        # sample of a moving average would otherwise be its slowest step).
        self.spec_catch_up = catch_up
        requests = self.scheduler.requests
        started = time.perf_counter()
        try:
            proposals = self.proposer.propose(wanted)
        except Exception:  # a failed proposer costs this step's speculation, nothing else
            logger.warning("proposer failed; decoding without speculation this step", exc_info=True)
            return
        if not self.spec_catch_up:
            self.spec_cost.observe_proposal(sum(w.k for w in wanted), time.perf_counter() - started)
        for w in wanted:
            p = proposals.get(w.request_id)
            if p is None or not p.token_ids:
                continue
            req = requests[w.request_id]
            req.spec_proposed_at = self.num_steps + 1  # the step about to run verifies them
            req.spec_token_ids = list(p.token_ids[: w.k])
            req.spec_draft_probs = None if p.probs is None else p.probs[: len(req.spec_token_ids)].float()

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
