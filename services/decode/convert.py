"""The protobuf edge of the decode service: tandem.v1 messages <-> domain values, errors -> status.

Servicers call these and nothing else touches `*_pb2` field by field. Every error a handler can
meet is mapped to a gRPC status in one place, `grpc_status`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import grpc

from common.engine.llm_engine import CompletionOutput, RequestError
from common.sampling.params import SamplingParams, SamplingParamsError
from services.decode.remote_kv import FirstToken, ReserveAborted, TransferFailed
from services.runtime.kv_wire import prompt_logprobs_to_proto, sampling_params_to_dict, token_logprob_to_proto
from tandem.v1 import common_pb2, decode_pb2

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class InvalidField(ValueError):
    """A request field the service cannot accept; answered INVALID_ARGUMENT naming the field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")


class NoReservation(LookupError):
    """Generate(REMOTE) for an id that holds no reservation (never made, expired, aborted)."""


class Draining(RuntimeError):
    """The worker is draining and takes no new requests."""


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place errors become gRPC status codes."""
    if isinstance(exc, (InvalidField, RequestError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, SamplingParamsError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"sampling.{exc}"
    if isinstance(exc, NoReservation):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, TransferFailed):
        return grpc.StatusCode.FAILED_PRECONDITION, f"KV transfer failed: {exc.reason}"
    if isinstance(exc, ReserveAborted):
        return grpc.StatusCode.CANCELLED, str(exc)
    if isinstance(exc, Draining):
        return grpc.StatusCode.UNAVAILABLE, str(exc) or "decode worker is draining"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class DecodeCall:
    """A validated DecodeRequest."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    remote: bool
    fail_on_kv_error: bool
    """KV_FAILURE_POLICY_FAIL; otherwise a failed transfer is recomputed locally."""
    speculative: bool = True
    """False: disable_speculative_decoding was set."""
    num_resumed_outputs: int = 0
    """The last N prompt tokens are outputs already sent (a migrated request)."""


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Wire sampling params -> domain params. Stop strings are the gateway's, so they are dropped."""
    d = sampling_params_to_dict(msg)
    d.pop("stop", None)
    d.pop("include_stop_str_in_output", None)
    unlimited = msg.HasField("max_tokens") and msg.max_tokens == 0  # 0 = up to the context window
    d.pop("max_tokens", None) if unlimited else None
    params = SamplingParams.from_dict(d)
    return dataclasses.replace(params, max_tokens=None) if unlimited else params


def decode_call_from_proto(msg: decode_pb2.DecodeRequest) -> DecodeCall:
    if not msg.request_id:
        raise InvalidField("request_id", "must be non-empty")
    if not msg.prompt_token_ids:
        raise InvalidField("prompt_token_ids", "the prompt is empty")
    if msg.kv_source == decode_pb2.KV_SOURCE_UNSPECIFIED:
        raise InvalidField("kv_source", "must be KV_SOURCE_LOCAL or KV_SOURCE_REMOTE")
    if msg.kv_source not in (decode_pb2.KV_SOURCE_LOCAL, decode_pb2.KV_SOURCE_REMOTE):
        raise InvalidField("kv_source", f"unknown value {msg.kv_source}")
    params = sampling_from_proto(msg.sampling)
    remote = msg.kv_source == decode_pb2.KV_SOURCE_REMOTE
    if remote and params.n != 1:
        raise InvalidField("sampling.n", f"remote KV serves n == 1, got {params.n}; use KV_SOURCE_LOCAL")
    resumed = msg.num_resumed_output_tokens
    if resumed and (remote or params.n != 1 or resumed >= len(msg.prompt_token_ids)):
        raise InvalidField("num_resumed_output_tokens", f"{resumed}: needs KV_SOURCE_LOCAL, n == 1 and fewer "
                           f"than the {len(msg.prompt_token_ids)} prompt tokens")
    return DecodeCall(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        params=params,
        remote=remote,
        fail_on_kv_error=msg.kv_failure_policy == decode_pb2.KV_FAILURE_POLICY_FAIL,
        speculative=not msg.disable_speculative_decoding,
        num_resumed_outputs=resumed,
    )


def first_token_from_proto(msg: common_pb2.TokenLogprob) -> FirstToken:
    top = [(t.token_id, t.logprob) for t in msg.top_logprobs]
    return FirstToken(msg.token_id, msg.logprob, top)


# --------------------------------------------------------------------------- responses


@dataclass(slots=True)
class ResponseBuilder:
    """Turns one request's CompletionOutputs into DecodeResponses and keeps its usage."""

    request_id: str
    num_prompt_tokens: int
    n: int
    with_logprobs: bool
    kv_source_used: int
    cached_tokens: int = 0
    num_sent: int = 0
    tokens_per_choice: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def response(self, out: CompletionOutput) -> decode_pb2.DecodeResponse:
        start = len(out.token_ids) - len(out.new_token_ids)
        delta = decode_pb2.DecodeChoiceDelta(choice_index=out.index, output_index=start, token_ids=out.new_token_ids)
        if self.with_logprobs:
            delta.logprobs.extend(
                token_logprob_to_proto(tok, lp, top or ()) for tok, (lp, top) in zip(out.new_token_ids, out.new_logprobs)
            )
        if out.finished:
            delta.finish_reason = _FINISH.get(out.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
            if out.finish_reason == "stop" and out.token_ids:
                delta.stop_token_id = out.stop_reason if isinstance(out.stop_reason, int) else out.token_ids[-1]
            self.finished.add(out.index)
        self.tokens_per_choice[out.index] = len(out.token_ids)
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        msg = decode_pb2.DecodeResponse(request_id=self.request_id, choices=[delta],
                                        prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs))
        if self.num_sent == 0:
            msg.kv_source_used = self.kv_source_used
        if out.finished and len(self.finished) == self.n:
            # The gateway stops reading once every choice finished, before closing(): the usage
            # (decode's prefix-cache hit) goes with the last token too.
            msg.usage.CopyFrom(self.usage())
        self.num_sent += 1
        return msg

    def closing(self) -> decode_pb2.DecodeResponse:
        """The stream's last message: usage, plus ABORT for choices that never finished."""
        msg = decode_pb2.DecodeResponse(request_id=self.request_id, usage=self.usage())
        for index in range(self.n):
            if index not in self.finished:
                msg.choices.append(
                    decode_pb2.DecodeChoiceDelta(
                        choice_index=index,
                        output_index=self.tokens_per_choice.get(index, 0),
                        finish_reason=common_pb2.FINISH_REASON_ABORT,
                    )
                )
        if self.num_sent == 0:
            msg.kv_source_used = self.kv_source_used
        return msg

    def usage(self) -> common_pb2.Usage:
        completion = sum(self.tokens_per_choice.values())
        return common_pb2.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.num_prompt_tokens + completion,
            cached_tokens=self.cached_tokens,
        )
