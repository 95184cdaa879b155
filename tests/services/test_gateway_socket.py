"""The gateway's HTTP socket, bound by the gateway or inherited from `tandem up` (--http-fd):
accepted connections get TCP_NODELAY, so SSE events go out at once."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from services.runtime.listen_socket import adopt_listener, bind_listener


def _listener(how: str) -> socket.socket:
    if how == "bound":
        return bind_listener("127.0.0.1", 0)
    held = bind_listener("127.0.0.1", 0, listen=True)  # the launcher's
    try:
        return adopt_listener(os.dup(held.fileno()))  # the gateway's inherited copy
    finally:
        held.close()


@pytest.mark.parametrize("how", ["bound", "inherited"])
def test_accepted_connections_have_nodelay(how: str):
    async def run() -> int:
        sock = _listener(how)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Capture(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                server_side = transport.get_extra_info("socket")
                accepted.set_result(server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Capture, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            value = await asyncio.wait_for(accepted, 30)
            writer.close()
            return value
        finally:
            server.close()
            await server.wait_closed()

    # Without it (a socket made with proto 0) asyncio leaves Nagle on: a streamed response's head
    # and first event then wait for the client's delayed ACK, ~40 ms per request.
    assert asyncio.run(run()) != 0


def test_an_inherited_descriptor_must_be_a_listening_tcp_socket():
    unbound = bind_listener("127.0.0.1", 0)  # bound, not listening
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for sock in (unbound, udp):
            with pytest.raises(ValueError, match="not a listening TCP socket"):
                adopt_listener(sock.fileno())
    finally:
        unbound.close()
        udp.close()
