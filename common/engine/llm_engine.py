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
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from common.attention.backend import get_attention_backend
from common.config import ConfigError, EngineConfig
from common.engine.model_runner import ModelRunner, SequenceInput
from common.engine.outputs import CompletionOutput, ComputedSpan, RequestError, Reservation, StepTimings
from common.engine.remote_kv import RemoteKVMixin
from common.engine.sequence import EngineSequence
from common.engine.speculation import SpeculationMixin
from common.kv_cache.kv_cache_manager import KVCacheManager
from common.kv_cache.paged_cache import PagedKVCache
from common.models.config import ModelConfig
from common.models.loader import load_model
from common.sampling.detokenizer import IncrementalDetokenizer
from common.sampling.params import SamplingParams
from common.sampling.prompt_logprobs import compute_prompt_logprobs
from common.sampling.sampler import Sampler
from common.sampling.stop_strings import StopStringMatcher
from common.scheduler.request import Request, RequestStatus
from common.scheduler.scheduler import Scheduler
from common.scheduler.step_budget import default_max_num_batched_tokens
from common.spec_decode.adaptive import AcceptancePrior
from common.spec_decode.goodput import GovernorsByBatch
from common.spec_decode.ngram import NgramProposer
from common.spec_decode.proposer import Proposer
from common.spec_decode.stats import SpecDecodeStats
from common.spec_decode.step_cost import StepCostModel
from common.structured.compiler import GrammarCompileError, GrammarCompiler
from common.structured.matcher import RequestGrammar

# The engine's public types live in outputs.py; importing them from here keeps working.
__all__ = ["CompletionOutput", "ComputedSpan", "LLMEngine", "RequestError", "Reservation", "StepTimings"]

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 512 * 2**20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine(SpeculationMixin, RemoteKVMixin):
    def __init__(
        self, config: EngineConfig, *, detokenize: bool = True, tokenizer=None, proposer: Proposer | None = None
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        attention = get_attention_backend(config.attention_backend, self.device)
        self.model, self.model_config = load_model(config.model, config.dtype, self.device, attention,
                                                   weight_dtype=config.weight_dtype)  # fmt: skip
        self.model_config: ModelConfig
        self.dtype = self.model.dtype  # the compute dtype (and the KV cache's)
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len, self.model_config.max_model_len)
        self.eos_token_ids = list(self.model_config.eos_token_ids)

        cache_cfg = config.cache
        num_blocks = self._num_kv_blocks()
        self.kv_cache = PagedKVCache(
            self.model_config.num_layers, num_blocks, cache_cfg.block_size,
            self.model_config.num_kv_heads, self.model_config.head_dim, self.dtype, self.device,
        )  # fmt: skip
        self.kv = KVCacheManager(num_blocks, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        if config.scheduler.max_num_batched_tokens is None:
            budget = default_max_num_batched_tokens(self.model_config, self.device.type, block_size=cache_cfg.block_size,
                                                    max_num_seqs=config.scheduler.max_num_seqs)  # fmt: skip
            self.config = config = replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=budget))
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.sampler = Sampler(self.device, seed=config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache.kv_caches, cache_cfg.block_size, self.device)
        self.detokenize = detokenize
        self.tokenizer = tokenizer
        if self.tokenizer is None and detokenize:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self._sequences: dict[str, EngineSequence] = {}
        self._children: dict[str, list[str]] = {}
        self.num_steps = 0
        self.last_step = StepTimings()
        self._bookkeeping_s = 0.0
        # Called on the engine's thread after each model pass with the spans it computed, before
        # any request of the step is finished and freed (the prefill service ships KV from it).
        self.on_computed: Callable[[list[ComputedSpan]], None] | None = None
        self._reserved: dict[str, EngineSequence] = {}
        spec = config.speculative
        if proposer is None and spec.enabled and spec.method == "ngram":
            proposer = NgramProposer()
        if spec.enabled and proposer is None:
            raise ConfigError("speculative method 'draft' needs a proposer (the decode service passes one)")
        self.proposer: Proposer | None = proposer if spec.enabled else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens)
        self.spec_cost = StepCostModel()  # measured price of a draft token, for adaptive k
        self.spec_governors = GovernorsByBatch()  # whether drafting steps deliver more than plain ones, per batch size
        self.spec_prior = AcceptancePrior()  # recent acceptance: where new requests' k starts
        self.plain_threads: int | None = None  # torch threads of steps without drafts (set at the first)
        self.spec_steps = 0  # steps that asked for proposals: the clock of the synchronised probes
        self.spec_catch_up = False  # this step's draft ingested tokens it had not seen (speculation.py)
        self.spec_predicted: float | None = None  # the cost model's expected value of this step's drafts
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first grammar request
        self._grammar_lock = threading.Lock()
        self._loaded_tokenizer: Any = None  # vocab_tokenizer()'s, where the engine has none of its own
        self._tokenizer_lock = threading.Lock()

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
        bad_bias = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise RequestError("logit_bias", f"token id {bad_bias} is outside the vocabulary [0, {vocab})")
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

    def vocab_tokenizer(self) -> Any:
        """The model's tokenizer: the engine's own, or (decode and prefill engines do not
        detokenize) loaded from the model folder on first use, one copy for every user (grammars,
        the decode worker's first-text streaming). Thread-safe; `tokenize` still refuses text
        where the engine was built without one."""
        if self.tokenizer is not None:
            return self.tokenizer
        with self._tokenizer_lock:
            if self._loaded_tokenizer is None:
                from transformers import AutoTokenizer

                self._loaded_tokenizer = AutoTokenizer.from_pretrained(self.config.model)
            return self._loaded_tokenizer

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The compiler for this engine's tokenizer (thread-safe: services compile off the engine thread)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                cfg = self.config.structured
                self._grammar_compiler = GrammarCompiler(
                    self.vocab_tokenizer(), self.model_config.vocab_size, self.eos_token_ids,
                    timeout_s=cfg.compile_timeout_s, cache_size=cfg.cache_size,
                )  # fmt: skip
            return self._grammar_compiler

    def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles params.grammar into the cache (any thread); raises RequestError naming the field."""
        if params.grammar is None:
            return
        try:
            self.grammar_compiler.compile(params.grammar)
        except GrammarCompileError as e:
            raise RequestError(e.field, e.message) from None

    def _request_grammar(self, params: SamplingParams) -> RequestGrammar | None:
        if params.grammar is None:
            return None
        self.compile_grammar(params)  # a cache hit when the service compiled it beforehand
        compiled = self.grammar_compiler.cached(params.grammar) or self.grammar_compiler.compile(params.grammar)
        return RequestGrammar(compiled, self.grammar_compiler.token_bans(params.grammar))

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        speculative: bool = True,
        num_resumed_outputs: int = 0,
    ) -> None:
        """num_resumed_outputs: the last N prompt tokens are outputs the client already has (a
        request migrated from a failed worker); penalties, min_tokens and a seeded generator
        count them as outputs, so the rest continues as the uninterrupted request would.
        params.max_tokens / min_tokens are then what is left of them."""
        params = params or SamplingParams()
        if request_id in self._children:
            raise RequestError("request_id", f"{request_id!r} is already running")
        if prompt_token_ids is None:
            if prompt is None:
                raise RequestError("prompt", "give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        max_tokens = self.validate(prompt_token_ids, params)
        if not 0 <= num_resumed_outputs < len(prompt_token_ids) or (num_resumed_outputs and params.n != 1):
            raise RequestError("num_resumed_outputs", f"must be in [0, prompt length) with n == 1, got "
                               f"{num_resumed_outputs} of {len(prompt_token_ids)} tokens, n={params.n}")
        self.compile_grammar(params)  # a bad or too-slow grammar fails here, before any state changes
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
                spec_enabled=speculative,
            )
            self._sequences[child_id] = self._new_sequence(request, request_id, i, child_params,
                                                           num_resumed_outputs)
            self.scheduler.add(request)
        self._children[request_id] = child_ids

    def _new_sequence(self, request: Request, parent_id: str, index: int, params: SamplingParams,
                      num_resumed_outputs: int = 0) -> EngineSequence:
        prompt, resumed = request.prompt_token_ids, []
        if num_resumed_outputs:
            prompt, resumed = prompt[:-num_resumed_outputs], list(prompt[-num_resumed_outputs:])
            if params.min_tokens:  # the sampler counts its outputs, resumed ones included
                params = replace(params, min_tokens=params.min_tokens + num_resumed_outputs, max_tokens=None)
        grammar = self._request_grammar(params)
        # A migrated request's matcher is rebuilt from the outputs the client already has.
        if grammar is not None and not all(grammar.accept(t) for t in resumed):
            raise RequestError(params.grammar.source, "the resumed outputs do not match the grammar")
        state = self.sampler.new_state(params, prompt, resumed, grammar)
        if state.generator is not None and not params.is_greedy:
            for _ in resumed:  # the draws that sampled the resumed tokens on the first worker
                self.sampler.skip_draw(state, self.model_config.vocab_size)
        return EngineSequence(
            request=request,
            parent_id=parent_id,
            index=index,
            state=state,
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

    def abort_request(self, request_id: str) -> bool:
        """Aborts a request (all its choices) in any state; its blocks are freed at once."""
        child_ids = self._children.pop(request_id, None)
        if child_ids is None:
            return False
        if self.proposer is not None:
            self.proposer.release(child_ids)
        for child_id in child_ids:
            if child_id in self._reserved:
                del self._reserved[child_id]
                self.kv.free(child_id)
            self.scheduler.abort(child_id)
            self._sequences.pop(child_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._sequences or self._reserved)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._children)

    def is_unfinished(self, request_id: str) -> bool:
        return request_id in self._children

    def unfinished_request_ids(self) -> list[str]:
        return list(self._children)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[CompletionOutput]:
        t0 = time.perf_counter()
        self.spec_catch_up = False
        self.spec_predicted = None
        if self.proposer is not None:
            self._propose()
            self._set_step_threads()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        t1 = time.perf_counter()
        self.num_steps += 1
        batch: list[SequenceInput] = []
        plain: list[tuple[EngineSequence, int]] = []  # (sequence, logits row) sampled the usual way
        drafted: list[tuple[EngineSequence, int, list[int]]] = []  # (sequence, first row, drafts) to verify
        prompt_rows: list[tuple[Request, int, int]] = []  # (request, first row, rows) for prompt logprobs
        row = 0
        for s in plan.scheduled:
            req = s.request
            drafts = list(req.spec_token_ids)
            start = req.num_computed_tokens
            n_real = s.num_new_tokens - len(drafts)
            completes = start + n_real == req.num_tokens
            num_logits = (1 + len(drafts)) if completes else 0
            n_prompt = 0
            if req.needs_prompt_logprobs:
                # Positions start .. min(end, P - 1) - 1 predict prompt tokens start + 1 ..; they are
                # the chunk's trailing positions (just before the sampling row, if any).
                n_prompt = max(0, min(start + n_real, req.num_prompt_tokens - 1) - start)
                prompt_rows.append((req, row, n_prompt))
            batch.append(
                SequenceInput(
                    token_ids=req.token_ids[start : start + n_real] + drafts,
                    start_pos=start,
                    block_table=self.kv.block_table(req.request_id),
                    num_logits=n_prompt + num_logits,
                )
            )
            row += n_prompt
            if completes and drafts:
                drafted.append((self._sequences[req.request_id], row, drafts))
            elif completes:
                plain.append((self._sequences[req.request_id], row))
            row += num_logits
        logits = self.runner.execute(batch)
        t2 = time.perf_counter()
        if prompt_rows:
            self._collect_prompt_logprobs(prompt_rows, logits)
        spans: list[ComputedSpan] = []
        for s in plan.scheduled:
            req = s.request
            if req.spec_token_ids:
                continue  # advanced after verification
            if self.on_computed is not None:
                start = req.num_computed_tokens
                spans.append(ComputedSpan(req.request_id, start, start + s.num_new_tokens, self.kv.block_table(req.request_id)))
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
        if spans:
            self.on_computed(spans)
        outputs = []
        self._bookkeeping_s = 0.0
        if plain:
            index = [r for _, r in plain]
            if index == list(range(logits.shape[0])):
                rows_logits = logits  # every row, in order (a plain decode step): no copy of [N, V]
            else:
                rows_logits = logits[torch.tensor(index, device=logits.device)]
            sampled = self.sampler.sample(rows_logits, [seq.state for seq, _ in plain], self.eos_token_ids)
            for (seq, _), token, logprob, top in zip(plain, sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
                outputs.append(self._append_tokens(seq, [token], [(logprob, top)]))
        if drafted:
            outputs.extend(self._verify(drafted, logits))
        end = time.perf_counter()
        book = self._bookkeeping_s
        if self.proposer is not None and not prompt_rows and all(len(b.token_ids) == b.num_logits for b in batch):
            # Decode-only step (every token scored): what a pass over n tokens costs here.
            self.spec_cost.observe_step(plan.num_batched_tokens, end - t1 - book)
            # From t0: the proposal's time (and a thread switch) is part of what drafting costs.
            # A draft's catch-up (a new prompt, a resume) is a one-off, not drafting's rate (speculation.py).
            if not (drafted and self.spec_catch_up):
                self.spec_governors.for_batch(len(batch)).observe(
                    bool(drafted), sum(len(o.new_token_ids) for o in outputs), len(batch), end - t0, self.spec_predicted if drafted else None
                )  # fmt: skip
        self.last_step = StepTimings(t1 - t0, t2 - t1, end - t2 - book, book, end - t0, plan.num_batched_tokens, len(batch))
        return outputs

    def _collect_prompt_logprobs(self, prompt_rows: list[tuple[Request, int, int]], logits: torch.Tensor) -> None:
        """Appends this step's prompt logprobs to each request (all rows in one log_softmax)."""
        index, targets, num_top = [], [], []
        for req, first, n in prompt_rows:
            start = req.num_computed_tokens
            index.extend(range(first, first + n))
            targets.extend(req.prompt_token_ids[start + 1 : start + 1 + n])
            num_top.extend([req.params.prompt_logprobs] * n)
        rows = torch.tensor(index, dtype=torch.long, device=logits.device)
        computed = compute_prompt_logprobs(logits[rows], targets, num_top)
        pos = 0
        for req, _, n in prompt_rows:
            # Entry i is position i's. A request preempted mid-prompt recomputes from position 0:
            # keep what it already has, append only the positions past it.
            have = len(req.prompt_logprobs) - req.num_computed_tokens
            req.prompt_logprobs.extend(computed[pos + max(0, have) : pos + n])
            pos += n

    def _append_tokens(
        self, seq: EngineSequence, tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]] | None]]
    ) -> CompletionOutput:
        """Appends sampled tokens one by one, applying the stop rules after each; tokens after a
        stop are dropped (they can come from accepted drafts)."""
        started = time.perf_counter()
        try:
            return self._append_tokens_timed(seq, tokens, logprobs)
        finally:
            self._bookkeeping_s += time.perf_counter() - started

    def _append_tokens_timed(
        self, seq: EngineSequence, tokens: list[int], logprobs: list[tuple[float, list[tuple[int, float]] | None]]
    ) -> CompletionOutput:
        req = seq.request
        params = req.params
        status: RequestStatus | None = None
        delta = ""
        new_tokens: list[int] = []
        new_logprobs = []
        grammar = seq.state.grammar
        for token, lp in zip(tokens, logprobs):
            if grammar is not None and not grammar.accept(token):
                # Only a token sampled without the mask can get here (a peer that ignored the spec).
                logger.error("request %s: token %d violates its grammar; aborting it", req.request_id, token)
                status = RequestStatus.FINISHED_ABORTED
                break
            req.token_ids.append(token)
            seq.state.output_token_ids.append(token)
            req.logprobs.append(lp)
            new_tokens.append(token)
            new_logprobs.append(lp)
            n_out = req.num_output_tokens
            if n_out >= params.min_tokens:
                if token in params.stop_token_ids:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
                elif not params.ignore_eos and token in self.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
            if status is None and grammar is not None and grammar.is_terminated:
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
            if status is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
                status = RequestStatus.FINISHED_LENGTH
            if seq.detokenizer is not None:
                piece = seq.detokenizer.add_tokens([token])
                if status is not None:
                    piece += seq.detokenizer.finish()  # release bytes held for an unfinished character
                if seq.stop_matcher is not None:
                    check = seq.stop_matcher.add_text(piece)
                    piece = check.text
                    if check.stop is not None:
                        status, req.stop_reason = RequestStatus.FINISHED_STOPPED, check.stop
                    elif status is not None:
                        piece += seq.stop_matcher.flush()
                delta += piece
            if status is not None:
                break
        seq.text += delta
        finished = status is not None
        first = req.num_output_tokens == len(new_tokens)  # this output starts the choice
        prompt_logprobs = req.prompt_logprobs if first and params.prompt_logprobs is not None and seq.index == 0 else None
        if finished:
            self._finish(seq, status)
        return CompletionOutput(
            request_id=seq.parent_id,
            index=seq.index,
            new_token_ids=new_tokens,
            new_logprobs=new_logprobs,
            text_delta=delta,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            token_ids=req.output_token_ids,
            text=seq.text,
            logprobs=req.logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _finish(self, seq: EngineSequence, status: RequestStatus) -> None:
        if self.proposer is not None and seq.request.adaptive_k is not None:
            self.proposer.release([seq.request.request_id])
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
