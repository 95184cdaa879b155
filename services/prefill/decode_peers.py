"""Connections to decode workers' KVTransfer services, with the handshake done once per address.

    get(address) -> first time: open a channel, Handshake(our layout) -> cache DecodePeer
                 -> later: the cached peer (no RPC)
    invalidate(address) after a failed transfer -> the next get() handshakes again
                 (decode may have restarted, possibly with another model)

Only compatible answers are cached, so a decode worker fixed and restarted is picked up at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from common.kv_transfer.codec import DEFAULT_MAX_PAYLOAD_BYTES, MAX_SAFE_PAYLOAD_BYTES
from common.kv_transfer.compat import KVLayout
from services.prefill.errors import FailureKind, PrefillError
from services.runtime.kv_wire import layout_to_proto
from services.runtime.tls import PLAINTEXT, Dialer
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class DecodePeer:
    address: str
    stub: kv_transfer_pb2_grpc.KVTransferStub
    max_payload_bytes: int
    """Per-piece payload limit agreed at the handshake (always < 4 MiB)."""
    layout: KVLayout
    """The layout both sides agreed on (ours)."""


class DecodePeers:
    def __init__(self, layout: KVLayout, sender_id: str, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 dialer: Dialer = PLAINTEXT) -> None:
        self.layout = layout
        self.dialer = dialer
        self.sender_id = sender_id
        self.max_payload_bytes = max_payload_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._peers: dict[str, DecodePeer] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, address: str) -> DecodePeer:
        """The handshaked peer; raises PrefillError INCOMPATIBLE (naming each field) or TRANSPORT."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        async with self._locks.setdefault(address, asyncio.Lock()):
            peer = self._peers.get(address)
            if peer is None:
                peer = await self._handshake(address)
                self._peers[address] = peer
            return peer

    async def _handshake(self, address: str) -> DecodePeer:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self.dialer.aio_channel(address, "decode")
        stub = kv_transfer_pb2_grpc.KVTransferStub(channel)
        request = kv_transfer_pb2.HandshakeRequest(layout=layout_to_proto(self.layout), sender_id=self.sender_id)
        try:
            answer = await stub.Handshake(request, timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise PrefillError(
                FailureKind.TRANSPORT, f"KV handshake with decode {address} failed: {e.code().name} {e.details()}"
            ) from e
        if not answer.compatible:
            raise PrefillError(
                FailureKind.INCOMPATIBLE, f"decode {address} refused our KV layout: {answer.reason or 'no reason given'}"
            )
        limit = answer.max_payload_bytes or self.max_payload_bytes
        limit = min(limit, self.max_payload_bytes, MAX_SAFE_PAYLOAD_BYTES)
        logger.info("KV handshake with decode %s: compatible, pieces <= %d bytes", address, limit)
        return DecodePeer(address, stub, limit, self.layout)

    def invalidate(self, address: str) -> None:
        self._peers.pop(address, None)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._peers.clear()
        for channel in channels:
            await channel.close()
