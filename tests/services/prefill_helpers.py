"""Helpers for the prefill service tests: a small real KV receiver and a gateway-side caller.

`KVReceiver` is a real KVTransfer server over a real decode-side LLMEngine (reserve_remote ->
write_remote_kv -> commit_remote), just big enough to test prefill against until/unless
services/decode is used instead. Its rules: a piece is verified (hash, checksum, shape) before
it is written; a stream that ends without is_last frees the reservation (INCOMPLETE).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.engine.llm_engine import LLMEngine, Reservation
from common.kv_transfer import KVChecksumError, KVChunkError, chunk_tensor
from common.sampling.params import SamplingParams
from services.runtime.engine_factory import kv_layout
from services.runtime.engine_loop import EngineLoop
from services.runtime.kv_wire import chunk_from_proto, handshake_response, sampling_params_from_dict
from services.runtime.settings import CommonSettings, EngineSettings, PrefillSettings
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, prefill_pb2

Status = kv_transfer_pb2.PushKVStatus


@dataclass
class PieceLog:
    request_id: str
    chunk_index: int
    block_ids: tuple[int, ...]
    message_bytes: int
    arrived_at: float
    is_last: bool


@dataclass
class KVReceiver(kv_transfer_pb2_grpc.KVTransferServicer):
    engine_loop: EngineLoop
    model_id: str
    max_payload_bytes: int = 0
    pieces: list[PieceLog] = field(default_factory=list)
    streams: dict[str, asyncio.Queue] = field(default_factory=dict)
    results: dict[str, kv_transfer_pb2.PushKVResponse] = field(default_factory=dict)

    @property
    def engine(self) -> LLMEngine:
        return self.engine_loop.engine

    @property
    def layout(self):
        return kv_layout(self.engine, self.model_id)

    async def Handshake(self, request, context):
        return handshake_response(self.layout, request, self.max_payload_bytes)

    async def PushKV(self, request_iterator, context):
        response = kv_transfer_pb2.PushKVResponse(status=Status.PUSH_KV_STATUS_INCOMPLETE)
        rid = None
        try:
            async for msg in request_iterator:
                rid = response.request_id = msg.request_id
                self.pieces.append(PieceLog(rid, msg.chunk_index, tuple(msg.block_ids), msg.ByteSize(), time.monotonic(), msg.is_last))
                if msg.compatibility_hash != self.layout.compatibility_hash():
                    return self._reject(response, Status.PUSH_KV_STATUS_INCOMPATIBLE, msg, "compatibility_hash")
                chunk = chunk_from_proto(msg)
                try:
                    data = chunk_tensor(chunk)
                except (KVChecksumError, KVChunkError) as e:
                    return self._reject(response, Status.PUSH_KV_STATUS_CHECKSUM_MISMATCH, msg, str(e))
                if chunk.block_ids:
                    await self.engine_loop.call(
                        lambda e: e.write_remote_kv(rid, list(chunk.block_ids), chunk.layer_start, chunk.layer_end, data)
                    )
                response.num_chunks_received += 1
                response.bytes_received += len(chunk.payload)
                if msg.is_last:
                    tok = msg.first_tokens[0]
                    await self.engine_loop.call(
                        lambda e: self.engine_loop.deliver([e.commit_remote(rid, tok.token_id, tok.logprob, None)])
                    )
                    response.status = Status.PUSH_KV_STATUS_ACCEPTED
            return response
        finally:
            if rid is not None:
                self.results[rid] = response
            if response.status != Status.PUSH_KV_STATUS_ACCEPTED and rid is not None:
                # Our rule: a failed transfer frees the reservation (shielded: the handler may be
                # cancelled, the abort must still complete and end the decode stream).
                await asyncio.shield(self.engine_loop.abort(rid))

    @staticmethod
    def _reject(response, status, msg, reason):
        response.status, response.reason, response.rejected_chunk_index = status, reason, msg.chunk_index
        return response

    async def reserve(self, rid: str, prompt: list[int], params: SamplingParams) -> Reservation:
        """Decode's Reserve: blocks set aside and the output stream opened (tokens land there)."""
        self.streams[rid] = self.engine_loop.open_stream(rid)
        reservation = await self.engine_loop.call(lambda e: e.reserve_remote(rid, prompt, params))
        assert reservation is not None
        return reservation

    async def tokens(self, rid: str) -> list[int]:
        out: list[int] = []
        async for item in self.engine_loop.stream(rid, self.streams.pop(rid)):
            out.extend(item.new_token_ids)
        return out


async def start_receiver(engine: LLMEngine, model_id: str, max_payload_bytes: int = 0):
    loop = EngineLoop(engine, name="receiver-engine")
    loop.start()
    receiver = KVReceiver(loop, model_id, max_payload_bytes)
    server = grpc.aio.server()
    kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return receiver, server, f"127.0.0.1:{port}"


def prefill_settings(model: Path, *, budget: int = 32, num_blocks: int = 128, metrics_port: int | None = None,
                     redis_url: str | None = None, cluster: str = "tandem", model_id: str = "tiny") -> PrefillSettings:
    return PrefillSettings(
        common=CommonSettings(model=str(model), served_model_name=model_id, host="127.0.0.1", grpc_port=50061,
                              metrics_port=metrics_port, redis_url=redis_url, cluster=cluster,
                              heartbeat_interval=0.2),
        engine=EngineSettings(device="cpu", dtype="float32", block_size=16, num_kv_blocks=num_blocks,
                              max_num_batched_tokens=budget, torch_threads=1),
    )  # fmt: skip


def prefill_chunks(rid: str, prompt: list[int], reservation: Reservation, decode_address: str, *,
                   chunk_size: int = 24, sampling: dict | None = None, compatibility_hash: str = "",
                   lease_deadline_unix_ms: int = 0):
    """The gateway's side of a Prefill call: header on chunk 0, then the prompt in chunks."""
    skip = reservation.num_cached_tokens
    header = prefill_pb2.PrefillHeader(
        decode_address=decode_address, dest_block_ids=reservation.block_ids[skip // 16:], num_skip_tokens=skip,
        num_prompt_tokens=len(prompt), sampling=sampling_params_from_dict(sampling or {"temperature": 0.0}),
        compatibility_hash=compatibility_hash, lease_deadline_unix_ms=lease_deadline_unix_ms,
    )  # fmt: skip
    starts = list(range(0, len(prompt), chunk_size))
    for i, s in enumerate(starts):
        yield prefill_pb2.PrefillChunk(
            request_id=rid, chunk_index=i, token_ids=prompt[s:s + chunk_size], is_last=i == len(starts) - 1,
            header=header if i == 0 else None,
        )  # fmt: skip
