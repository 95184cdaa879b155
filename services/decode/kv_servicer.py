"""The KVTransfer gRPC service hosted by decode: Handshake and PushKV (see kv_transfer.proto)."""

from __future__ import annotations

import asyncio
import logging

from common.kv_transfer.codec import DEFAULT_MAX_PAYLOAD_BYTES
from services.decode.convert import first_token_from_proto
from services.decode.remote_kv import PieceRejected, PieceStatus, RemoteKVTable
from services.runtime import tracing
from services.runtime.kv_wire import chunk_from_proto, handshake_response
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)
Status = kv_transfer_pb2.PushKVStatus

_STATUS = {
    PieceStatus.ACCEPTED: Status.PUSH_KV_STATUS_ACCEPTED,
    PieceStatus.UNKNOWN_REQUEST: Status.PUSH_KV_STATUS_UNKNOWN_REQUEST,
    PieceStatus.CHECKSUM_MISMATCH: Status.PUSH_KV_STATUS_CHECKSUM_MISMATCH,
    PieceStatus.INCOMPATIBLE: Status.PUSH_KV_STATUS_INCOMPATIBLE,
    PieceStatus.INVALID: Status.PUSH_KV_STATUS_INVALID,
    PieceStatus.INCOMPLETE: Status.PUSH_KV_STATUS_INCOMPLETE,
}


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(self, table: RemoteKVTable) -> None:
        self.table = table

    async def Handshake(self, request, context) -> kv_transfer_pb2.HandshakeResponse:
        response = handshake_response(self.table.layout, request, max_payload_bytes=DEFAULT_MAX_PAYLOAD_BYTES)
        if not response.compatible:
            logger.warning("KV handshake from %s refused: %s", request.sender_id or "?", response.reason)
        return response

    async def PushKV(self, request_iterator, context) -> kv_transfer_pb2.PushKVResponse:
        with tracing.span("kv.receive", tracing.context_from_grpc(context), kind=tracing.SpanKind.SERVER) as span:
            response = await self._push_kv(request_iterator)
            if span.is_recording():
                tracing.set_attributes(span, {
                    "tandem.request_id": response.request_id, "tandem.kv.bytes": response.bytes_received,
                    "tandem.kv.num_pieces": response.num_chunks_received, "tandem.kv.status": Status.Name(response.status),
                })  # fmt: skip
                if response.status != Status.PUSH_KV_STATUS_ACCEPTED:
                    tracing.mark_error(span, response.reason or Status.Name(response.status))
            return response

    async def _push_kv(self, request_iterator) -> kv_transfer_pb2.PushKVResponse:
        response = kv_transfer_pb2.PushKVResponse()
        request_id: str | None = None
        complete = False
        try:
            async for msg in request_iterator:
                if request_id is None:
                    request_id = response.request_id = msg.request_id
                elif msg.request_id != request_id:
                    raise PieceRejected(PieceStatus.INVALID, msg.chunk_index,
                                        f"chunk {msg.chunk_index}: request_id {msg.request_id!r} != the stream's {request_id!r}")  # fmt: skip
                if complete:
                    raise PieceRejected(PieceStatus.INVALID, msg.chunk_index,
                                        f"chunk {msg.chunk_index}: sent after the is_last piece")  # fmt: skip
                pending = self.table.lookup(request_id, msg.chunk_index)
                first = [first_token_from_proto(t) for t in msg.first_tokens]
                await self.table.accept_piece(pending, chunk_from_proto(msg), msg.compatibility_hash, first,
                                              msg.prefill_cached_tokens)  # fmt: skip
                response.num_chunks_received += 1
                response.bytes_received += len(msg.payload)
                complete = msg.is_last
        except PieceRejected as rejected:
            # A stray piece after a complete transfer is refused without undoing the transfer.
            return self._reject(response, None if complete else request_id, rejected)
        except asyncio.CancelledError:  # the sender went away mid-transfer
            if request_id is not None and not complete:
                self.table.fail(request_id, "KV sender cancelled the PushKV stream", metric_reason="transport")
            raise
        except Exception as e:  # a broken stream or a piece nobody foresaw: never leave blocks behind
            if not complete:
                logger.exception("PushKV %s failed", request_id)
                return self._reject(response, request_id, PieceRejected(PieceStatus.INVALID, None, f"{type(e).__name__}: {e}"))
            logger.warning("PushKV %s: the stream broke after its last piece landed (ignored): %s", request_id, e)
        if not complete:
            return self._reject(response, request_id, PieceRejected(
                PieceStatus.INCOMPLETE, None, f"stream ended after {response.num_chunks_received} piece(s) without is_last"))  # fmt: skip
        response.status = Status.PUSH_KV_STATUS_ACCEPTED
        return response

    def _reject(self, response, request_id: str | None, rejected: PieceRejected) -> kv_transfer_pb2.PushKVResponse:
        response.status = _STATUS[rejected.status]
        response.reason = rejected.reason
        if rejected.chunk_index is not None and rejected.status is not PieceStatus.INCOMPLETE:
            response.rejected_chunk_index = rejected.chunk_index
        if request_id is not None and rejected.status is not PieceStatus.UNKNOWN_REQUEST:
            self.table.fail(request_id, f"PushKV {rejected.status.value}: {rejected.reason}",
                            metric_reason=rejected.status.metric_reason)  # fmt: skip
        logger.warning("PushKV %s rejected: %s", response.request_id, rejected.reason)
        return response
