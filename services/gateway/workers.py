"""Clients of the internal workers (Decode, Prefill): channels, calls, and the protobuf edge.

One grpc.aio channel per worker address, reused by every request (a channel multiplexes calls
over one HTTP/2 connection). Everything the orchestrator gets back is a plain dataclass.
`WorkerHealth` remembers which decode workers answered recently (GetLoad probes and real calls):
GET /health is 200 only when one of them did.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.sampling.params import SamplingParams
from services.gateway.choice_stream import RawLogprob
from services.runtime.kv_wire import sampling_params_from_dict
from services.runtime.local_stream import LocalConnections, LocalStreamCall
from services.runtime.tls import PLAINTEXT, Dialer
from services.runtime.tracing import Metadata
from tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
RESERVE_STATUSES = {
    decode_pb2.RESERVE_STATUS_RESERVED: "reserved",
    decode_pb2.RESERVE_STATUS_NO_CAPACITY: "no_capacity",
    decode_pb2.RESERVE_STATUS_TOO_LONG: "too_long",
    decode_pb2.RESERVE_STATUS_INCOMPATIBLE: "incompatible",
    decode_pb2.RESERVE_STATUS_DRAINING: "draining",
}


# --------------------------------------------------------------------------- domain types

@dataclass(slots=True)
class Reservation:
    status: str  # one of RESERVE_STATUSES' values, or "invalid"
    message: str = ""
    num_cached_tokens: int = 0
    dest_block_ids: tuple[int, ...] = ()
    lease_deadline_unix_ms: int = 0
    kv_transfer_address: str = ""
    compatibility_hash: str = ""
    hold: grpc.aio.UnaryStreamCall | None = None
    """The open ReserveAndHold call: while it is open this process holds the reservation (decode
    closes it once a Generate claims it); cancelled, or this process dead, decode frees it."""

    def release(self) -> None:
        """Lets go of the reservation: decode frees it now unless a Generate already claimed it."""
        if self.hold is not None:
            self.hold.cancel()


@dataclass(slots=True)
class DecodeDelta:
    index: int
    output_index: int
    token_ids: list[int]
    logprobs: list[RawLogprob] | None
    finish_reason: str | None
    stop_token_id: int | None


@dataclass(slots=True)
class DecodeMessage:
    choices: list[DecodeDelta]
    cached_tokens: int | None  # from the stream's last message (usage)
    prompt_logprobs: list[RawLogprob] | None = None  # when decode computed the prompt and was asked


@dataclass(slots=True)
class PrefillDone:
    first_tokens: list[RawLogprob]  # one per choice
    num_cached_tokens: int
    prompt_logprobs: list[RawLogprob] | None = None  # one per prompt token after the first


def _raw_logprob(msg: common_pb2.TokenLogprob) -> RawLogprob:
    return (msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top_logprobs])


_SAMPLING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "stop")


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    # A shallow dict (sampling_params_from_dict takes tuples and a GrammarSpec as they are):
    # 5 us against 19 us with dataclasses.asdict's deep copy. Stop strings are left out: they
    # are the gateway's job (it owns the detokenizer).
    return sampling_params_from_dict({name: getattr(params, name) for name in _SAMPLING_NAMES})


# --------------------------------------------------------------------------- channels

# A worker that died and came back (tandem up restarts it on the same port) is dialled again
# within ~1 s, not after gRPC's default reconnect backoff of up to 120 s.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 1000)]


class WorkerChannels:
    """One channel per worker address (mTLS when the dialer has an identity)."""

    def __init__(self, dialer: Dialer = PLAINTEXT) -> None:
        self.dialer = dialer
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[type, str], Any] = {}
        self._local: dict[str, LocalConnections] = {}

    def channel(self, address: str, role: str = "decode") -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.dialer.aio_channel(address, role, options=CHANNEL_OPTIONS)
        return channel

    def stub(self, kind: type, address: str, role: str = "decode") -> Any:
        """kind(channel) for the worker, made once (a stub registers every method of its service
        with the channel: a few dozen us a request when made per call)."""
        stub = self._stubs.get((kind, address))
        if stub is None:
            stub = self._stubs[(kind, address)] = kind(self.channel(address, role))
        return stub

    def decode(self, address: str) -> decode_pb2_grpc.DecodeStub:
        return self.stub(decode_pb2_grpc.DecodeStub, address)

    def prefill(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        return self.stub(prefill_pb2_grpc.PrefillStub, address, "prefill")

    def local(self, path: str) -> LocalConnections:
        """The kept connections to a worker's Unix socket on this host."""
        connections = self._local.get(path)
        if connections is None:
            connections = self._local[path] = LocalConnections(path)
        return connections

    async def close(self) -> None:
        local, self._local = list(self._local.values()), {}
        for connections in local:
            connections.close()
        channels, self._channels = list(self._channels.values()), {}
        self._stubs = {}
        for channel in channels:
            await channel.close()


# --------------------------------------------------------------------------- decode calls

class DecodeClient:
    def __init__(self, channels: WorkerChannels, address: str, local_socket: str | None = None) -> None:
        self.address = address
        self.channels = channels
        self.local_socket = local_socket
        """The worker's Unix socket on this host (Generate goes there; gRPC if it cannot be reached)."""
        self.stub = channels.decode(address)
        self.health = channels.stub(health_pb2_grpc.HealthStub, address)

    async def reserve(self, request_id: str, prompt: Sequence[int], timeout_s: float,
                      metadata: Metadata | None = None) -> Reservation:
        """Decode.ReserveAndHold: the answer within timeout_s (else TimeoutError, and the call is
        cancelled); a reservation stays held by the call (Reservation.hold) until a Generate claims
        it, so it never waits for its lease when this process dies first."""
        request = decode_pb2.ReserveRequest(request_id=request_id, prompt_token_ids=prompt)
        call = self.stub.ReserveAndHold(request, metadata=metadata)  # no deadline: it must outlive the answer
        try:
            async with asyncio.timeout(timeout_s):
                msg = await call.read()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # A decode worker older than ReserveAndHold (a rolling upgrade): its lease alone holds it.
            call = None
            msg = await self.stub.Reserve(request, timeout=timeout_s, metadata=metadata)
        except BaseException:  # timed out, broken or cancelled: decode frees what it made
            call.cancel()
            raise
        if msg is grpc.aio.EOF:
            return Reservation(status="invalid", message="ReserveAndHold ended without an answer")
        return Reservation(
            status=RESERVE_STATUSES.get(msg.status, "invalid"), message=msg.message,
            num_cached_tokens=msg.num_cached_tokens, dest_block_ids=tuple(msg.dest_block_ids),
            lease_deadline_unix_ms=msg.lease_deadline_unix_ms,
            kv_transfer_address=msg.kv_transfer_address or self.address,
            compatibility_hash=msg.compatibility_hash,
            hold=call,
        )

    def generate(self, request_id: str, prompt: Sequence[int], params: SamplingParams, *, remote: bool,
                 disable_speculative_decoding: bool = False, num_resumed_outputs: int = 0,
                 metadata: Metadata | None = None) -> grpc.aio.UnaryStreamCall | LocalStreamCall:
        """Opens the Decode.Generate stream (read it with `messages`; cancel() aborts on decode).
        num_resumed_outputs: the prompt's last N tokens were generated already (migration)."""
        request = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params),
            kv_source=decode_pb2.KV_SOURCE_REMOTE if remote else decode_pb2.KV_SOURCE_LOCAL,
            kv_failure_policy=decode_pb2.KV_FAILURE_POLICY_RECOMPUTE,
            disable_speculative_decoding=disable_speculative_decoding,
            num_resumed_output_tokens=num_resumed_outputs,
        )
        if self.local_socket is not None:
            return LocalStreamCall(self.local_socket, "Generate", request, decode_pb2.DecodeResponse, metadata,
                                   fallback=lambda: self.stub.Generate(request, metadata=metadata),
                                   connections=self.channels.local(self.local_socket))
        return self.stub.Generate(request, metadata=metadata)

    async def is_serving(self, timeout_s: float) -> bool:
        """grpc.health.v1 says SERVING (decode's health follows its engine loop: a hung engine
        or a frozen process does not)."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    @staticmethod
    async def messages(call: grpc.aio.UnaryStreamCall | LocalStreamCall) -> AsyncIterator[DecodeMessage]:
        async for msg in call:
            choices = [
                DecodeDelta(
                    index=c.choice_index, output_index=c.output_index, token_ids=list(c.token_ids),
                    logprobs=[_raw_logprob(lp) for lp in c.logprobs] if c.logprobs else None,
                    finish_reason=FINISH_REASONS.get(c.finish_reason),
                    stop_token_id=c.stop_token_id if c.HasField("stop_token_id") else None,
                )
                for c in msg.choices
            ]
            cached = msg.usage.cached_tokens if msg.HasField("usage") else None
            yield DecodeMessage(choices, cached, [_raw_logprob(t) for t in msg.prompt_logprobs] or None)

    async def abort(self, request_id: str, reason: str, timeout_s: float = 2.0,
                    metadata: Metadata | None = None) -> bool:
        response = await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id, reason=reason),
                                         timeout=timeout_s, metadata=metadata)
        return response.aborted

    async def get_load(self, timeout_s: float) -> decode_pb2.DecodeLoad:
        return await self.stub.GetLoad(common_pb2.GetLoadRequest(), timeout=timeout_s)


# --------------------------------------------------------------------------- prefill calls

class PrefillClient:
    def __init__(self, channels: WorkerChannels, address: str) -> None:
        self.address = address
        self.stub = channels.prefill(address)

    def prefill(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                reservation: Reservation, chunk_size: int,
                metadata: Metadata | None = None) -> grpc.aio.StreamStreamCall:
        """Opens the Prefill stream and sends the prompt in chunks of chunk_size tokens."""
        header = prefill_pb2.PrefillHeader(
            decode_address=reservation.kv_transfer_address, dest_block_ids=reservation.dest_block_ids,
            num_skip_tokens=reservation.num_cached_tokens, num_prompt_tokens=len(prompt),
            sampling=sampling_to_proto(params), compatibility_hash=reservation.compatibility_hash,
            lease_deadline_unix_ms=reservation.lease_deadline_unix_ms,
        )

        async def chunks() -> AsyncIterator[prefill_pb2.PrefillChunk]:
            starts = range(0, len(prompt), chunk_size)
            for i, start in enumerate(starts):
                yield prefill_pb2.PrefillChunk(
                    request_id=request_id, chunk_index=i, token_ids=prompt[start:start + chunk_size],
                    is_last=i == len(starts) - 1, header=header if i == 0 else None)

        return self.stub.Prefill(chunks(), metadata=metadata)

    @staticmethod
    async def wait_done(call: grpc.aio.StreamStreamCall) -> PrefillDone | None:
        """Reads progress until `done`; None if the stream ended without it."""
        async for progress in call:
            if progress.done:
                return PrefillDone([_raw_logprob(t) for t in progress.first_tokens], progress.num_cached_tokens,
                                   [_raw_logprob(t) for t in progress.prompt_logprobs] or None)
        return None

    async def abort(self, request_id: str, reason: str, timeout_s: float = 2.0,
                    metadata: Metadata | None = None) -> bool:
        response = await self.stub.Abort(common_pb2.AbortRequest(request_id=request_id, reason=reason),
                                         timeout=timeout_s, metadata=metadata)
        return response.aborted


# --------------------------------------------------------------------------- health

class WorkerHealth:
    """Which decode workers answered lately: GetLoad probes plus every successful call."""

    def __init__(self, channels: WorkerChannels, fresh_s: float) -> None:
        self.channels = channels
        self.fresh_s = fresh_s
        self._last_ok: dict[str, float] = {}
        self.block_size: dict[str, int] = {}  # learned from GetLoad, for prefix hashes

    def mark_ok(self, address: str) -> None:
        self._last_ok[address] = time.monotonic()

    def is_fresh(self, address: str) -> bool:
        last = self._last_ok.get(address)
        return last is not None and time.monotonic() - last <= self.fresh_s

    def any_fresh(self, addresses: Iterable[str]) -> bool:
        return any(self.is_fresh(a) for a in addresses)

    async def probe(self, addresses: Iterable[str], timeout_s: float) -> None:
        async def one(address: str) -> None:
            try:
                load = await DecodeClient(self.channels, address).get_load(timeout_s)
            except grpc.aio.AioRpcError as e:
                logger.debug("decode worker %s did not answer GetLoad: %s", address, e.code().name)
                return
            self.block_size[address] = load.block_size or 16
            self.mark_ok(address)

        await asyncio.gather(*(one(a) for a in set(addresses)))
