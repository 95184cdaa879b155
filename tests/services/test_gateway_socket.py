"""The gateway's HTTP socket: accepted connections get TCP_NODELAY, so SSE events go out at once."""

from __future__ import annotations

import asyncio
import socket

from services.gateway.main import _bind


def test_accepted_connections_have_nodelay():
    async def run() -> int:
        sock = _bind("127.0.0.1", 0)
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
