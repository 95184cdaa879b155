"""The gateway's prompt stream -> one validated `PrefillJob`.

    chunk 0: header (decode address, dest blocks, skip, sampling, hash, lease) + tokens
    chunk 1..N: tokens, N is_last            -> PromptAssembler.finish() -> PrefillJob

Everything the gateway can get wrong is checked here, each error naming its field, so the
engine and the KV sender only ever see a consistent job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.sampling.params import SamplingParams, SamplingParamsError
from services.prefill.errors import PrefillError, invalid


@dataclass(frozen=True, slots=True)
class PrefillHeader:
    """PrefillHeader of prefill.proto as plain values (see the proto for each field)."""

    decode_address: str
    dest_block_ids: tuple[int, ...]
    num_skip_tokens: int
    num_prompt_tokens: int
    sampling: dict
    """OpenAI-named sampling fields the gateway set (kv_wire.sampling_params_to_dict)."""
    compatibility_hash: str
    lease_deadline_unix_ms: int


@dataclass(frozen=True, slots=True)
class PromptChunk:
    request_id: str
    chunk_index: int
    token_ids: tuple[int, ...]
    is_last: bool
    header: PrefillHeader | None


@dataclass(slots=True)
class PrefillJob:
    """A complete, validated request: what the engine computes and where its KV goes."""

    request_id: str
    header: PrefillHeader
    params: SamplingParams
    """The request's sampling params with max_tokens=1: prefill samples only the first token."""
    prompt_token_ids: list[int]
    chunk_ends: list[int]
    """chunk_ends[i] = prompt tokens up to the end of gateway chunk i (for progress reports)."""

    def chunk_index_at(self, num_tokens: int) -> int:
        """The gateway chunk holding position num_tokens - 1."""
        for i, end in enumerate(self.chunk_ends):
            if num_tokens <= end:
                return i
        return len(self.chunk_ends) - 1


def first_token_params(sampling: dict) -> SamplingParams:
    """The request's params for sampling token 0 only. min_tokens is clamped to 1 so EOS masking of
    the first token is unchanged (SamplingParams refuses min_tokens > max_tokens)."""
    d = dict(sampling)
    n = d.get("n", 1)
    if n != 1:
        raise invalid("sampling.n", f"remote prefill serves n == 1 (got {n}); n > 1 prefills on decode")
    d["max_tokens"] = 1
    d["min_tokens"] = min(int(d.get("min_tokens", 0)), 1)
    try:
        return SamplingParams.from_dict(d)
    except SamplingParamsError as e:
        raise invalid(f"sampling.{e.field}", e.message) from e
    except (TypeError, ValueError) as e:
        raise invalid("sampling", str(e)) from e


def check_header(header: PrefillHeader, block_size: int) -> None:
    if not header.decode_address or ":" not in header.decode_address:
        raise invalid("header.decode_address", f"must be host:port, got {header.decode_address!r}")
    n, skip = header.num_prompt_tokens, header.num_skip_tokens
    if n <= 0:
        raise invalid("header.num_prompt_tokens", "must be > 0 (the prompt is empty)")
    if skip % block_size:
        raise invalid("header.num_skip_tokens", f"{skip} is not a multiple of the block size {block_size}")
    if skip >= n:
        raise invalid("header.num_skip_tokens", f"{skip} must be < num_prompt_tokens ({n})")
    want = -(-n // block_size) - skip // block_size
    if len(header.dest_block_ids) != want:
        raise invalid(
            "header.dest_block_ids",
            f"got {len(header.dest_block_ids)} blocks; prompt positions [{skip}, {n}) need {want} "
            f"(block size {block_size})",
        )
    if len(set(header.dest_block_ids)) != len(header.dest_block_ids):
        raise invalid("header.dest_block_ids", "contains duplicates")
    if header.lease_deadline_unix_ms < 0:
        raise invalid("header.lease_deadline_unix_ms", f"must be >= 0, got {header.lease_deadline_unix_ms}")


@dataclass(slots=True)
class PromptAssembler:
    """Accumulates one call's chunks, in order; finish() returns the job."""

    block_size: int
    request_id: str = ""
    header: PrefillHeader | None = None
    params: SamplingParams | None = None
    tokens: list[int] = field(default_factory=list)
    chunk_ends: list[int] = field(default_factory=list)
    complete: bool = False

    def add(self, chunk: PromptChunk) -> None:
        index = len(self.chunk_ends)
        if self.complete:
            raise invalid("chunk_index", f"chunk {chunk.chunk_index} arrived after the is_last chunk")
        if chunk.chunk_index != index:
            raise invalid("chunk_index", f"expected {index}, got {chunk.chunk_index} (chunks must be in order, no gaps)")
        if index == 0:
            if not chunk.request_id:
                raise invalid("request_id", "is required")
            if chunk.header is None:
                raise invalid("header", "chunk 0 must carry the PrefillHeader")
            check_header(chunk.header, self.block_size)
            self.params = first_token_params(chunk.header.sampling)
            self.request_id, self.header = chunk.request_id, chunk.header
        elif chunk.request_id != self.request_id:
            raise invalid("request_id", f"chunk {index} has {chunk.request_id!r}, chunk 0 had {self.request_id!r}")
        assert self.header is not None
        self.tokens.extend(chunk.token_ids)
        if len(self.tokens) > self.header.num_prompt_tokens:
            raise invalid("token_ids", f"more tokens than header.num_prompt_tokens ({self.header.num_prompt_tokens})")
        self.chunk_ends.append(len(self.tokens))
        self.complete = chunk.is_last

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def finish(self) -> PrefillJob:
        if not self.chunk_ends:
            raise invalid("header", "the stream ended before chunk 0")
        assert self.header is not None and self.params is not None
        if not self.complete:
            raise invalid("is_last", "the stream ended before a chunk with is_last")
        if len(self.tokens) != self.header.num_prompt_tokens:
            raise invalid(
                "token_ids", f"chunks carry {len(self.tokens)} tokens, header.num_prompt_tokens says {self.header.num_prompt_tokens}"
            )
        return PrefillJob(self.request_id, self.header, self.params, self.tokens, self.chunk_ends)


__all__ = ["PrefillError", "PrefillHeader", "PrefillJob", "PromptAssembler", "PromptChunk", "check_header"]
