"""The gateway's REST listening socket: bound here, or handed down by the launcher.

`tandem up` binds the REST port itself and passes the socket to the gateway and its warm
standby (`--http-fd N`). The port then never closes while the launcher lives: when the gateway
dies, connections that arrive during its death (the kernel tears down a SIGKILLed process's
memory before its sockets, ~0.2 s at load) and until the standby serves wait in the socket's
backlog for the standby, instead of landing in a dying process's backlog and being reset. Only
the connections the dead gateway had accepted are lost with it. gRPC cannot serve an inherited
socket (grpcio binds its own), so the gRPC port keeps the short window.
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default: a burst of reconnects waits instead of being refused


def bind_listener(host: str, port: int, *, listen: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port); with `listen`, already accepting into its backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on accepted sockets whose
    # proto says TCP. Without it an SSE stream's head and first event meet Nagle's algorithm and
    # the client's delayed ACK: each streamed response after a connection's first waited ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        if listen:
            sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def adopt_listener(fd: int) -> socket.socket:
    """The listening socket inherited as descriptor `fd` (the launcher's --http-fd)."""
    sock = socket.socket(fileno=fd)  # family, type and proto read from the descriptor
    if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ValueError(f"--http-fd {fd} is not a listening TCP socket")
    return sock
