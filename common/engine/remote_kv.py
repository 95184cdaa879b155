"""The decode side of disaggregated prefill, inside the engine.

    reserve_remote(prompt)      set aside every block the prompt needs (minus prefix-cache hits)
    write_remote_kv(pieces)     pushed KV lands only in the request's own reserved blocks
    commit_remote(first token)  the request joins the running batch, as if it had prefilled here
"""

from __future__ import annotations

import torch

from common.engine.outputs import CompletionOutput, RequestError, Reservation
from common.sampling.params import SamplingParams
from common.scheduler.request import Request, RequestStatus


class RemoteKVMixin:
    """LLMEngine's remote-KV entry points (uses its kv, kv_cache, scheduler and sampler)."""

    def reserve_remote(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> Reservation | None:
        """Sets aside blocks for a prompt a prefill worker will compute. None when the pool or the
        running-request limit has no room now (the caller may try another worker or wait)."""
        if request_id in self._children:
            raise RequestError("request_id", f"{request_id!r} is already running")
        if params.n != 1:
            raise RequestError("n", "remote prefill serves n == 1; send n > 1 to local prefill")
        max_tokens = self.validate(prompt_token_ids, params)
        if self.scheduler.num_running + len(self._reserved) >= self.config.scheduler.max_num_seqs:
            return None
        request = Request(request_id, list(prompt_token_ids), params, max_tokens)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        cached = self.kv.get_computed_prefix(request_id, request.token_ids)
        if not self.kv.allocate_slots(request_id, len(prompt_token_ids)):
            self.kv.free(request_id)
            return None
        request.num_cached_tokens = cached
        seq = self._new_sequence(request, request_id, 0, params)
        self._reserved[request_id] = seq
        self._children[request_id] = [request_id]
        return Reservation(request_id, self.kv.block_table(request_id), cached)

    def write_remote_kv(
        self, request_id: str, block_ids: list[int], layer_start: int, layer_end: int, data: torch.Tensor
    ) -> None:
        """Writes pushed KV [layers, 2, len(block_ids), block_size, kv_heads, head_dim] into the
        request's own reserved blocks (never into shared prefix-cache blocks)."""
        seq = self._reserved.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        table = self.kv.block_table(request_id)
        own = set(table[seq.request.num_cached_tokens // self.kv.block_size :])
        foreign = [b for b in block_ids if b not in own]
        if foreign:
            raise RequestError("block_ids", f"blocks {foreign} are not reserved for {request_id!r}")
        if not 0 <= layer_start < layer_end <= self.model_config.num_layers:
            raise RequestError("layer_range", f"[{layer_start}, {layer_end}) outside [0, {self.model_config.num_layers})")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        self.kv_cache.storage[layer_start:layer_end].index_copy_(2, index, data.to(self.device, self.dtype))

    def commit_remote(
        self,
        request_id: str,
        first_token: int,
        logprob: float,
        top: list[tuple[int, float]] | None,
        params: SamplingParams | None = None,
    ) -> CompletionOutput:
        """All prompt KV has landed: the request joins the running batch with prefill's first token.

        `params` replaces the sampling params given at reservation time: decode reserves from the
        prompt alone and learns the request's real params only from its Generate call."""
        seq = self._reserved[request_id]
        vocab = self.model_config.vocab_size
        bad = next((t for t in [first_token, *(t for t, _ in top or ())] if not 0 <= t < vocab), None)
        if bad is not None:  # refused before any change: a bad id would break the next step for everyone
            raise RequestError("first_tokens", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params is not None:
            max_tokens = self.validate(seq.request.prompt_token_ids, params)  # raises before any change
            seq.request.params, seq.request.max_tokens = params, max_tokens
            seq = self._new_sequence(seq.request, request_id, 0, params)
        del self._reserved[request_id]
        req = seq.request
        if seq.state.generator is not None and not req.params.is_greedy:
            # Prefill drew the first token from the same seed: skip that draw so the rest of the
            # stream matches what this request would sample had it prefilled here.
            self.sampler.skip_draw(seq.state, self.model_config.vocab_size)
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_full_blocks(request_id, req.token_ids, req.num_computed_tokens)
        self.scheduler.add_running(req)
        self._sequences[request_id] = seq
        return self._append_tokens(seq, [first_token], [(logprob, top)])

    def release_remote(self, request_id: str) -> bool:
        """Frees a reservation whose KV never got committed (its owner left); a request that is
        already running under this id is not touched. True if blocks were freed."""
        if request_id not in self._reserved:
            return False
        return self.abort_request(request_id)

    def reserved_request_ids(self) -> list[str]:
        return list(self._reserved)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)
