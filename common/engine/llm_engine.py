"""The engine: requests in, tokens out, one `step()` at a time.

    add_request ──> Scheduler.schedule() ──> StepPlan ──> ModelRunner.execute() ──> logits
                                                                                     │
    outputs <── stop checks / detokenize <── Sampler.sample() <──────────────────────┘

It owns the model, the paged KV cache, the scheduler and the sampler, and nothing about the
network: services wrap it. A request with n > 1 becomes n sibling requests (ids `<id>#<i>`)
that share the prompt's full KV blocks by reference count.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch

from common.attention.backend import get_attention_backend
from common.config import EngineConfig
from common.engine.model_runner import ModelRunner, SequenceInput
from common.kv_cache.kv_cache_manager import KVCacheManager
from common.kv_cache.paged_cache import PagedKVCache
from common.models.config import ModelConfig
from common.models.loader import load_model
from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.stop_strings import StopStringMatcher
from common.sampling.params import SamplingParams
from common.sampling.sampler import Sampler, SamplingState
from common.scheduler.request import Request, RequestStatus
from common.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20


class RequestError(ValueError):
    """A request the engine cannot serve; `field` names the offending input."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(slots=True)
class CompletionOutput:
    """What one step produced for one sequence (a choice of a request)."""

    request_id: str
    """The id given to add_request (shared by the n choices)."""
    index: int
    """Choice index, 0..n-1."""
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, list[tuple[int, float]] | None]]
    text_delta: str
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    token_ids: list[int] = field(default_factory=list)
    """All output tokens so far."""
    text: str = ""
    """All output text so far (when the engine detokenizes)."""
    logprobs: list[tuple[float, list[tuple[int, float]] | None]] = field(default_factory=list)
    """Per output token so far: (logprob of the chosen token, top-N or None)."""


@dataclass(slots=True)
class _Sequence:
    request: Request
    parent_id: str
    index: int
    state: SamplingState
    detokenizer: IncrementalDetokenizer | None
    stop_matcher: StopStringMatcher | None
    text: str = ""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, detokenize: bool = True, tokenizer=None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        attention = get_attention_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(config.model, config.dtype, self.device, attention)
        self.model_config: ModelConfig
        self.dtype = next(self.model.parameters()).dtype
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        self.eos_token_ids = list(self.model_config.eos_token_ids)

        cache_cfg = config.cache
        num_blocks = self._num_kv_blocks()
        self.kv_cache = PagedKVCache(
            self.model_config.num_layers, num_blocks, cache_cfg.block_size,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.dtype, self.device,
        )  # fmt: skip
        self.kv = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(self.device, seed=config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache.kv_caches, cache_cfg.block_size, self.device)
        self.detokenize = detokenize
        self.tokenizer = tokenizer
        if self.tokenizer is None and detokenize:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self._sequences: dict[str, _Sequence] = {}
        self._children: dict[str, list[str]] = {}
        self.num_steps = 0

    def _num_kv_blocks(self) -> int:
        c, m = self.config.cache, self.model_config
        per_block = PagedKVCache.bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, c.block_size, self.dtype)
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if c.kv_cache_memory is not None:
            return max(1, c.kv_cache_memory // per_block)
        if self.device.type == "cuda":
            return PagedKVCache.num_blocks_for_memory_fraction(
                c.gpu_memory_fraction, m.num_layers, m.num_kv_heads, m.head_dim, c.block_size, self.dtype, self.device
            )
        return max(1, DEFAULT_CPU_KV_CACHE_MEMORY // per_block)

    # -- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError("prompt", "this engine has no tokenizer; send prompt_token_ids")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Checks a request against this engine's limits; returns its resolved max_tokens."""
        if not prompt_token_ids:
            raise RequestError("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - len(prompt_token_ids)
        if room < 1:
            raise RequestError(
                "prompt", f"the prompt has {len(prompt_token_ids)} tokens; this model's context is {self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise RequestError(
                "max_tokens",
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"length {self.max_model_len}",
            )
        needed = self.kv.num_blocks_needed(len(prompt_token_ids) + max_tokens)
        if needed > self.kv.num_blocks:
            raise RequestError(
                "max_tokens",
                f"prompt + max_tokens needs {needed} KV blocks but the cache has {self.kv.num_blocks}",
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        params = params or SamplingParams()
        if request_id in self._children:
            raise RequestError("request_id", f"{request_id!r} is already running")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        max_tokens = self.validate(prompt_token_ids, params)
        now = time.monotonic()
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for i, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)  # siblings must not draw alike
            request = Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                params=child_params,
                max_tokens=max_tokens,
                arrival_time=now,
                fork_parent=child_ids[0] if i > 0 else None,
            )
            self._sequences[child_id] = _Sequence(
                request=request,
                parent_id=request_id,
                index=i,
                state=self.sampler.new_state(child_params, request.prompt_token_ids, []),
                detokenizer=(
                    IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
                    if self.detokenize
                    else None
                ),
                stop_matcher=(
                    StopStringMatcher(params.stop, params.include_stop_str_in_output)
                    if self.detokenize and params.stop
                    else None
                ),
            )
            self.scheduler.add(request)
        self._children[request_id] = child_ids

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request (all its choices) in any state; its blocks are freed at once."""
        child_ids = self._children.pop(request_id, None)
        if child_ids is None:
            return False
        for child_id in child_ids:
            self.scheduler.abort(child_id)
            self._sequences.pop(child_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._sequences)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[CompletionOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        self.num_steps += 1
        batch: list[SequenceInput] = []
        to_sample: list[_Sequence] = []
        for s in plan.scheduled:
            req = s.request
            start = req.num_computed_tokens
            completes = start + s.num_new_tokens == req.num_tokens
            batch.append(
                SequenceInput(
                    token_ids=req.token_ids[start : start + s.num_new_tokens],
                    start_pos=start,
                    block_table=self.kv.block_table(req.request_id),
                    num_logits=1 if completes else 0,
                )
            )
            if completes:
                to_sample.append(self._sequences[req.request_id])
        logits = self.runner.execute(batch)
        for s in plan.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        if not to_sample:
            return []
        sampled = self.sampler.sample(logits, [seq.state for seq in to_sample], self.eos_token_ids)
        outputs = []
        for seq, token, logprob, top in zip(to_sample, sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
            outputs.append(self._append_token(seq, token, logprob, top))
        return outputs

    def _append_token(self, seq: _Sequence, token: int, logprob: float, top) -> CompletionOutput:
        req = seq.request
        params = req.params
        req.token_ids.append(token)
        seq.state.output_token_ids.append(token)
        req.logprobs.append((logprob, top))
        status: RequestStatus | None = None
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if token in params.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            elif not params.ignore_eos and token in self.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.add_tokens([token])
            if status is not None:
                delta += seq.detokenizer.finish()  # release bytes held for an unfinished character
            if seq.stop_matcher is not None:
                check = seq.stop_matcher.add_text(delta)
                delta = check.text
                if check.stop is not None:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, check.stop
                elif status is not None:
                    delta += seq.stop_matcher.flush()
        seq.text += delta
        finished = status is not None
        if finished:
            self._finish(seq, status)
        return CompletionOutput(
            request_id=seq.parent_id,
            index=seq.index,
            new_token_ids=[token],
            new_logprobs=[(logprob, top)],
            text_delta=delta,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            token_ids=req.output_token_ids,
            text=seq.text,
            logprobs=req.logprobs,
        )

    def _finish(self, seq: _Sequence, status: RequestStatus) -> None:
        self.scheduler.finish(seq.request, status)
        del self._sequences[seq.request.request_id]
        siblings = self._children.get(seq.parent_id, [])
        if all(s not in self._sequences for s in siblings):
            self._children.pop(seq.parent_id, None)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # -- offline convenience ------------------------------------------------------------------
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[list[CompletionOutput]]:
        """Runs prompts to completion; returns, per prompt, the final output of each choice."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{self.num_steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            if isinstance(prompt, str):
                self.add_request(rid, prompt=prompt, params=p)
            else:
                self.add_request(rid, params=p, prompt_token_ids=list(prompt))
        final: dict[str, dict[int, CompletionOutput]] = {rid: {} for rid in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id][out.index] = out
        return [[final[rid][i] for i in sorted(final[rid])] for rid in ids]
