"""The line protocol between `tandem up` and a warm standby gateway, over a Unix socketpair.

    launcher (services/launcher/standby.py)        standby (`tandem gateway --standby-fd N`)
    socketpair(); spawn the gateway's argv         imports, tokenizer, registry view, decode
      plus --standby-fd N (its end)          ->      probe (Gateway.warm_up); binds no port
                                             <-    READY
    the active gateway died: SERVE           ->    binds REST + gRPC on the gateway's ports
                                                   (SO_REUSEADDR) and serves
    EOF (launcher gone), SIGTERM or SIGINT   ->    exits 0, having bound and served nothing

A pipe or a signal would also carry SERVE; the socketpair carries READY back on the same fd, and
its EOF tells a standby whose launcher died to go (PR_SET_PDEATHSIG does too, on Linux only).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Awaitable

logger = logging.getLogger(__name__)

READY = b"ready\n"
SERVE = b"serve\n"


async def await_promotion(fd: int, warm_up: Awaitable[None]) -> bool:
    """The standby's side: run warm_up, say READY, then wait. True: SERVE came (bind and serve
    now); False: EOF, SIGTERM or SIGINT (exit without serving). A SERVE that comes before the
    warm-up is done cuts it short: serving a little colder beats serving later."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=socket.socket(fileno=fd))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    promoted = False
    command = asyncio.ensure_future(reader.readline())
    stopped = asyncio.ensure_future(stop.wait())
    warm = asyncio.ensure_future(warm_up)
    try:
        done, _ = await asyncio.wait({command, stopped, warm}, return_when=asyncio.FIRST_COMPLETED)
        if warm in done:
            if warm.exception() is not None:  # a colder start, not a reason to stop standing by
                logger.warning("standby warm-up failed: %r", warm.exception())
            with contextlib.suppress(ConnectionError):
                writer.write(READY)
                await writer.drain()
            logger.info("standby: ready, waiting for %r on fd %d before binding any port", SERVE, fd)
            await asyncio.wait({command, stopped}, return_when=asyncio.FIRST_COMPLETED)
        promoted = command.done() and not command.cancelled() and command.exception() is None \
            and command.result() == SERVE
    finally:
        if promoted:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        else:
            _ignore_stop_signals(loop)
        for task in (command, stopped, warm):
            task.cancel()
        writer.close()
    logger.info("standby: %s", "promoted: binding the public ports" if promoted else "stopped unpromoted")
    return promoted


def _ignore_stop_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Going now, unpromoted: a second SIGTERM (the launcher's stop after the one its thread's
    exit sent through PR_SET_PDEATHSIG) must not turn the clean exit into -15. Removing asyncio's
    handler restores SIG_DFL, so SIG_IGN follows at once, with nothing between the two calls."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
