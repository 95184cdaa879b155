"""Speculative decoding on a decode worker: the engine built with its proposer, and what it reports.

    --speculative-method draft  -> RemoteDraftProposer (draft worker at --draft-address or from
                                   the registry); ngram -> the engine's in-process n-gram proposer
    engine.spec_stats           -> tandem_spec_decode_* counters (after every step) and the
                                   acceptance rate / mean accepted length in the heartbeat extra
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from common.config import SpeculativeConfig
from common.engine.llm_engine import LLMEngine
from common.models.config import ModelConfig
from services.decode.draft_client import DraftTargetInfo, RemoteDraftProposer
from services.runtime.engine_factory import build_engine, engine_config
from services.runtime.metrics import ServiceMetrics
from services.runtime.registry import (EXTRA_SPEC_ACCEPTANCE_RATE, EXTRA_SPEC_DRAFT_COST, EXTRA_SPEC_MEAN_ACCEPTED_LEN,
                                       CachedRegistryView, Registry, Role)  # fmt: skip
from services.runtime.settings import DecodeSettings
from services.runtime.tls import Dialer, TlsIdentity

logger = logging.getLogger(__name__)


def build_decode_engine(settings: DecodeSettings, *, draft_address: str | None = None) -> LLMEngine:
    """The decode engine, speculating when --speculative-method and --num-speculative-tokens say so.

    The draft worker is found in the registry (role draft); `draft_address` pins one instead
    (tests, or a deployment without Redis)."""
    common, method, k = settings.common, settings.speculative_method, settings.num_speculative_tokens
    if method == "none" or k == 0:
        return build_engine(common, settings.engine, detokenize=False)
    if settings.engine.torch_threads:
        import torch

        torch.set_num_threads(settings.engine.torch_threads)
    config = dataclasses.replace(engine_config(common.model, settings.engine),
                                 speculative=SpeculativeConfig(method, k, settings.speculative_adaptive,
                                                               settings.spec_torch_threads))  # fmt: skip
    proposer = make_draft_proposer(settings, draft_address or settings.draft_address) if method == "draft" else None
    return LLMEngine(config, detokenize=False, proposer=proposer)


def make_draft_proposer(settings: DecodeSettings, draft_address: str | None = None) -> RemoteDraftProposer:
    common = settings.common
    vocab = ModelConfig.from_pretrained(common.model).vocab_size
    target = DraftTargetInfo.of_model(common.model, vocab)
    timeout_s = settings.draft_timeout_ms / 1000
    dialer = Dialer(TlsIdentity.from_settings(common))
    if draft_address or not common.redis_url:
        if not draft_address:
            logger.warning("--speculative-method draft without --redis-url: no draft worker can be found")
        return RemoteDraftProposer(target, timeout_s, address=draft_address, dialer=dialer)
    view = CachedRegistryView(Registry(common.redis_url, common.cluster), refresh_interval_s=1.0).start()

    def discover() -> list[str]:
        workers = [w for w in view.workers(Role.DRAFT) if not w.extra.get("draining")]
        return [w.address for w in sorted(workers, key=lambda w: -w.kv_blocks_free)]

    def close() -> None:
        view.stop()
        view.registry.close()

    return RemoteDraftProposer(target, timeout_s, discover=discover, on_close=close, dialer=dialer)


class SpecMetrics:
    """Feeds engine.spec_stats into the decode metrics; call on the engine thread after a step."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics
        self._draft = self._accepted = 0
        self._per_pos: list[int] = []

    def observe(self, engine: LLMEngine) -> None:
        stats = engine.spec_stats
        if stats.num_draft_tokens > self._draft:
            self.metrics.spec_draft.inc(stats.num_draft_tokens - self._draft)
            self._draft = stats.num_draft_tokens
        if stats.num_accepted_tokens > self._accepted:
            self.metrics.spec_accepted.inc(stats.num_accepted_tokens - self._accepted)
            self._accepted = stats.num_accepted_tokens
        for pos, count in enumerate(stats.accepted_per_position):
            seen = self._per_pos[pos] if pos < len(self._per_pos) else 0
            if count > seen:
                self.metrics.spec_per_pos.labels(position=str(pos)).inc(count - seen)
        self._per_pos = list(stats.accepted_per_position)
        cost = draft_token_cost(engine)
        self.metrics.spec_cost.set(float("nan") if cost is None else cost)


def draft_token_cost(engine: LLMEngine) -> float | None:
    """Adaptive k's measured price of a draft token at the current batch (None until measured):
    the one figure the metric and `tandem status` both report."""
    return engine.spec_cost.draft_token_cost(max(engine.scheduler.num_running, 1))


def spec_extra(engine: LLMEngine) -> dict[str, Any]:
    """Heartbeat extra shown by `tandem status` (empty until something was verified)."""
    stats = engine.spec_stats
    if engine.proposer is None or not stats.num_drafts:
        return {}
    extra = {EXTRA_SPEC_ACCEPTANCE_RATE: round(stats.acceptance_rate, 4),
             EXTRA_SPEC_MEAN_ACCEPTED_LEN: round(stats.mean_accepted_length, 3)}  # fmt: skip
    cost = draft_token_cost(engine)
    if cost is not None:
        extra[EXTRA_SPEC_DRAFT_COST] = round(cost, 3)
    return extra


def close_proposer(engine: LLMEngine) -> None:
    close = getattr(engine.proposer, "close", None)
    if close is not None:
        close()
