"""Server-streaming calls over a Unix socket, for a client on the same host as the server.

On one box the gateway reaches its decode worker for every request: over gRPC that hop cost the
tiny model ~1.4 ms of its time to first token and ~1.4 ms of CPU under the two processes' GILs
(grpc.aio's Python and Cython layers on both sides; docs/performance.md). The same call over a
Unix socket with length-prefixed protobuf frames costs a fraction of that. It is a transport, not
a second contract: the messages are the proto's (DecodeRequest in, DecodeResponse out), the
servicer is the gRPC servicer itself (called with a LocalContext), and errors come back as the
gRPC status codes the servicer aborted with, raised to the client as grpc.aio.AioRpcError, so
callers cannot tell the two apart. Only server-streaming methods (Decode.Generate) are served.

    one call at a time:   client -> HEADER {"method", "metadata"}, REQUEST bytes
    on a connection       server -> MESSAGE bytes ..., STATUS {"code", "details"}
    the client closing the connection mid-call cancels the call (the servicer's generator is
    cancelled, as gRPC cancels it, so the request is aborted and its KV blocks freed); after a
    STATUS the connection carries the client's next call.

Connections are kept and reused (`LocalConnections`, one pool per socket per client): a connect
and the server's accept cost ~0.7 ms a call on a 2-core VM (asyncio on both sides, measured
against a kept connection's round trip), inside every request's time to first token. A caller
that read every message it wanted (every choice finished) releases the call instead of
cancelling it: the status is read in the background and the connection goes back to the pool.
A kept connection the server has closed meanwhile (a restarted worker) is noticed before its
first answer, and the call goes once more over a new connection.

The socket file is made owner-only (0600): whoever may connect could also read the process's
memory. The gRPC port stays the worker's address for everything else (health, KV transfer,
other hosts); a client whose socket connect fails makes the same call over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import struct
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<IB")  # payload length, kind
HEADER, REQUEST, MESSAGE, STATUS = 1, 2, 3, 4
MAX_FRAME_BYTES = 64 << 20  # a request of a whole context's tokens is well under this
SOCKET_PATH_MAX = 104  # sockaddr_un's sun_path, less a margin (108 on Linux, 104 on macOS)


def frame(kind: int, payload: bytes) -> bytes:
    return _FRAME.pack(len(payload), kind) + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    length, kind = _FRAME.unpack(await reader.readexactly(_FRAME.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes is over the limit of {MAX_FRAME_BYTES}")
    return kind, await reader.readexactly(length)


class LocalAbort(Exception):
    """LocalContext.abort: the call ends with this status (grpc.aio's AbortError, here)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """What the servicers use of grpc.aio.ServicerContext, for a call over the Unix socket."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple((str(k), str(v)) for k, v in metadata)
        self._callbacks: list[Callable[[Any], None]] = []
        self._cancelled = False

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise LocalAbort(code, details)

    def peer(self) -> str:
        return "unix:local"

    def cancelled(self) -> bool:
        return self._cancelled

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        self._callbacks.append(callback)

    def done(self, cancelled: bool) -> None:
        self._cancelled = cancelled
        for callback in self._callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - one callback's failure must not skip the others
                logger.exception("done callback of a local call failed")


@dataclass(frozen=True)
class StreamMethod:
    handler: Callable[[Any, LocalContext], AsyncIterator[Any]]  # the gRPC servicer's method
    request_type: Any  # the request message class


class LocalStreamServer:
    """Serves `methods` (name -> StreamMethod) on a Unix socket at `path`."""

    def __init__(self, path: str, methods: Mapping[str, StreamMethod]) -> None:
        self.path = path
        self.methods = dict(methods)
        self._server: asyncio.AbstractServer | None = None
        self._calls: set[asyncio.Task] = set()
        self.connections_accepted = 0

    async def start(self) -> LocalStreamServer:
        if len(self.path.encode()) > SOCKET_PATH_MAX:
            raise OSError(f"socket path {self.path!r} is longer than {SOCKET_PATH_MAX} bytes")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a previous run's (a restarted worker binds the same path)
        old_mask = os.umask(0o177)  # created owner-only: no window in which others may connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        finally:
            os.umask(old_mask)
        return self

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for task in list(self._calls):
            task.cancel()
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._calls.add(task)
        self.connections_accepted += 1
        try:
            while await self._serve_one(reader, writer):
                pass
        finally:
            self._calls.discard(task)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serves the connection's next call: True once its status went out (the connection
        carries the next one), False when the connection ends."""
        try:
            try:
                kind, header = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return False  # the client closed it between calls
            head = json.loads(header) if kind == HEADER else None
            method = self.methods.get(head.get("method")) if isinstance(head, dict) else None
            kind, payload = await read_frame(reader)
            if method is None or kind != REQUEST:
                raise ValueError(f"not a call of {sorted(self.methods)}")
            request = method.request_type.FromString(payload)
        except Exception as e:  # noqa: BLE001 - a malformed call: say so, and drop the connection
            with contextlib.suppress(ConnectionError):
                await _send_status(writer, grpc.StatusCode.INVALID_ARGUMENT, f"malformed local call: {e}")
            return False
        return await self._call(method, request, head.get("metadata") or (), reader, writer)

    async def _call(self, method: StreamMethod, request: Any, metadata: Sequence[tuple[str, str]],
                    reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:  # fmt: skip
        context = LocalContext(metadata)
        # The client closing its end cancels the call, as a cancelled gRPC stream does.
        this = asyncio.current_task()
        watcher = asyncio.get_running_loop().create_task(_cancel_on_eof(reader, this))
        code, details = grpc.StatusCode.OK, ""
        responses = method.handler(request, context)
        try:
            async for response in responses:
                writer.write(frame(MESSAGE, response.SerializeToString()))
                await writer.drain()
        except LocalAbort as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            context.done(cancelled=True)
            return False
        except ConnectionError:
            # The client closed its end while we wrote: it left (a cancel, as gRPC has it, not
            # a failure of the servicer: no traceback, whose formatting cost the decode worker's
            # event loop ~1 ms under the engine thread's GIL).
            context.done(cancelled=True)
            return False
        except Exception as e:  # noqa: BLE001 - as grpc answers a servicer's unexpected exception
            logger.exception("local call failed")
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            watcher.cancel()
            # A stream left at a yield (the client gone mid-write) runs its cleanup now (the
            # servicer aborts the request and frees its blocks), not whenever it is collected.
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        context.done(cancelled=False)
        # The watcher must be gone before the next call is read (one reader at a time); if it
        # saw the connection end first, it cancelled this task and the wait raises.
        await asyncio.wait({watcher})
        try:
            await _send_status(writer, code, details)
        except ConnectionError:
            return False
        return True


async def _cancel_on_eof(reader: asyncio.StreamReader, task: asyncio.Task) -> None:
    # The client sends nothing during a call (its next call waits for this one's status), so
    # anything read here is its end closing (b"") or a broken client: either way the call ends.
    with contextlib.suppress(ConnectionError):
        await reader.read(1)
    task.cancel()


async def _send_status(writer: asyncio.StreamWriter, code: grpc.StatusCode, details: str) -> None:
    writer.write(frame(STATUS, json.dumps({"code": code.value[0], "details": details}).encode()))
    await writer.drain()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LocalConnections:
    """A client's idle connections to one socket, reused call after call (the event loop's own:
    make one per loop)."""

    def __init__(self, path: str, max_idle: int = 64) -> None:
        self.path = path
        self.max_idle = max_idle
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._draining: set[asyncio.Task] = set()
        self._closed = False

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    async def take(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """(reader, writer, kept): an idle connection (kept=True), else a new one (OSError when
        the socket cannot be reached)."""
        while self._idle:
            reader, writer = self._idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer, True
            writer.close()  # the server closed it while it waited here
        reader, writer = await asyncio.open_unix_connection(self.path)
        return reader, writer, False

    def give_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A connection whose last call ended with its status: it carries the next call."""
        if not self._closed and len(self._idle) < self.max_idle and not writer.is_closing() and not reader.at_eof():
            self._idle.append((reader, writer))
        else:
            writer.close()

    def after_status(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        """Reads what is left of a released call up to its status in the background, then keeps
        the connection (closed instead if the status does not come within timeout_s)."""
        task = asyncio.get_running_loop().create_task(self._drain(reader, writer, timeout_s))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while (await read_frame(reader))[0] != STATUS:
                    pass
        except asyncio.CancelledError:
            writer.close()
            raise
        except Exception:  # noqa: BLE001 - no status (timed out, broken): the connection is not reused
            writer.close()
            return
        self.give_back(reader, writer)

    async def settle(self) -> None:
        """Waits until the released calls' statuses were read (their connections kept or closed)."""
        if self._draining:
            await asyncio.wait(set(self._draining))

    def close(self) -> None:
        """Closes the idle connections; calls still running close theirs when they end."""
        self._closed = True
        for task in list(self._draining):
            task.cancel()
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()


RELEASE_TIMEOUT_S = 30.0  # a released call's status comes right after its last message


class LocalStreamCall:
    """One server-streaming call over a Unix socket, read as the gateway reads grpc.aio's
    UnaryStreamCall (async iteration, cancel(), AioRpcError on a non-OK status). `fallback` makes
    the same call over gRPC when the socket cannot be reached (a worker on another host, or
    restarting). `connections`: the pool the call takes its connection from and gives it back to
    (None: a connection of its own, closed at the end)."""

    def __init__(self, path: str, method: str, request: Any, response_type: Any,
                 metadata: Sequence[tuple[str, str]] | None, fallback: Callable[[], Any],
                 connections: LocalConnections | None = None) -> None:  # fmt: skip
        self.path, self.method, self.request, self.response_type = path, method, request, response_type
        self.metadata = [(str(k), str(v)) for k, v in (metadata or ())]
        self.fallback = fallback
        self.connections = connections
        self._writer: asyncio.StreamWriter | None = None
        self._fallback_call: Any = None
        self._cancelled = False
        self._released = False
        self._done = False

    def cancel(self) -> bool:
        if self._done or self._cancelled:
            return False
        self._cancelled = True
        if self._fallback_call is not None:
            self._fallback_call.cancel()
        if self._writer is not None:
            self._writer.close()  # the server cancels the call when it sees the connection go
        return True

    def release(self) -> None:
        """The caller read every message it wanted and the call is over on the server too (every
        choice finished): stop reading without cancelling, and keep the connection for the next
        call once the status came (within RELEASE_TIMEOUT_S, else it is closed). Over gRPC, or
        without kept connections, the same as cancel()."""
        if self._done or self._cancelled:
            return
        if self._fallback_call is not None or self.connections is None:
            self.cancel()
            return
        self._released = True

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        if self.connections is not None:
            return await self.connections.take()
        reader, writer = await asyncio.open_unix_connection(self.path)
        return reader, writer, False

    async def _over_grpc(self, why: OSError) -> AsyncIterator[Any]:
        logger.debug("local socket %s unreachable (%s): the call goes over gRPC", self.path, why)
        self._fallback_call = self.fallback()
        async for response in self._fallback_call:
            yield response

    async def _responses(self) -> AsyncIterator[Any]:
        if self._cancelled:
            raise asyncio.CancelledError
        try:
            reader, writer, kept = await self._connect()
        except OSError as e:
            async for response in self._over_grpc(e):
                yield response
            return
        self._writer = writer
        call = (frame(HEADER, json.dumps({"method": self.method, "metadata": self.metadata}).encode())
                + frame(REQUEST, self.request.SerializeToString()))  # fmt: skip
        status_read = False
        try:
            writer.write(call)
            answered = False
            while True:
                try:
                    kind, payload = await read_frame(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    if not kept or answered or self._cancelled:
                        raise
                    # A kept connection the server closed before answering (it restarted, or
                    # stopped serving it): the call never ran there. Once more, on a new one,
                    # or over gRPC if the socket cannot be reached now (as at the start).
                    writer.close()
                    try:
                        reader, writer = await asyncio.open_unix_connection(self.path)
                    except OSError as e:
                        async for response in self._over_grpc(e):
                            yield response
                        return
                    self._writer, kept = writer, False
                    writer.write(call)
                    continue
                answered = True
                if self._cancelled:  # what was in flight when cancel() came is not read (as grpc.aio)
                    raise asyncio.CancelledError
                if kind == MESSAGE:
                    yield self.response_type.FromString(payload)
                elif kind == STATUS:
                    status_read = True
                    status = json.loads(payload)
                    code = _CODES.get(status.get("code"), grpc.StatusCode.UNKNOWN)
                    if code != grpc.StatusCode.OK:
                        raise _rpc_error(code, str(status.get("details", "")))
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as e:
            if self._cancelled:
                raise asyncio.CancelledError from e
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"local socket {self.path}: {e or type(e).__name__}") from e
        finally:
            self._done = True
            if self.connections is None or self._cancelled:
                writer.close()
            elif status_read:
                self.connections.give_back(reader, writer)
            elif self._released:
                self.connections.after_status(reader, writer, RELEASE_TIMEOUT_S)
            else:
                writer.close()  # left mid-call (the reader was cancelled): the server cancels it


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
