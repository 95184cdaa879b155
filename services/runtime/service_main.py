"""The process entry shared by `tandem gateway|prefill|decode|draft`.

Parse settings (flags > TANDEM_* env > defaults), set up tracing from OTEL_* variables and
logging, serve until SIGTERM/SIGINT, then shut down (drain) the service. Exit codes: 0 after a
clean shutdown, 1 when the service could not start (a port taken, say), 2 for bad settings.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from services.runtime import heap, tracing
from services.runtime.settings import SettingsError, parse_settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


async def serve_until_signal(
    settings: Any,
    serve: Callable[[Any], Awaitable[Any]],
    shutdown: Callable[[Any], Awaitable[None]],
    watch: Callable[[Any], Awaitable[Any] | None] | None = None,
) -> None:
    """serve(settings) -> handle; waits for a signal (or for watch(handle) to end); shutdown(handle)."""
    handle = await serve(settings)
    heap.freeze_long_lived()  # start-up's objects out of every later collection (heap.py)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.ensure_future(stop.wait())]
    watched = watch(handle) if watch is not None else None
    if watched is not None:
        waits.append(asyncio.ensure_future(watched))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    logging.getLogger(__name__).info("shutting down")
    await shutdown(handle)


def run_service(
    role: str,
    argv: Sequence[str] | None,
    serve: Callable[[Any], Awaitable[Any]],
    shutdown: Callable[[Any], Awaitable[None]],
    watch: Callable[[Any], Awaitable[Any] | None] | None = None,
) -> int:
    try:
        settings = parse_settings(role, argv)
        tracing.setup_tracing(role)  # only the OTEL_* variables turn it on
    except SettingsError as e:
        print(f"tandem {role}: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.common.log_level.upper(), format=LOG_FORMAT)
    try:
        asyncio.run(serve_until_signal(settings, serve, shutdown, watch))
    except OSError as e:  # e.g. the port is taken
        logging.getLogger(f"tandem.{role}").error("%s failed to start: %s", role, e)
        return 1
    except SettingsError as e:  # found at start: an unreadable TLS key, say
        print(f"tandem {role}: {e}", file=sys.stderr)
        return 2
    return 0
