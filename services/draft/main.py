"""`tandem draft --model DIR`: a draft worker process, configured by flags and TANDEM_* env vars.

Runs until SIGTERM/SIGINT, then drains: health NOT_SERVING, Propose refused (decode carries on
without speculation), deregistered, exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from services.draft.server import DEFAULT_DRAIN_GRACE_S, serve
from services.runtime import tracing
from services.runtime.settings import DraftSettings, SettingsError, parse_settings

logger = logging.getLogger("tandem.draft")


async def run(settings: DraftSettings, drain_grace_s: float = DEFAULT_DRAIN_GRACE_S) -> None:
    handle = await serve(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("signal received: draining (grace %.0f s)", drain_grace_s)
    await handle.drain(drain_grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings = parse_settings("draft", argv)
        tracing.setup_tracing("draft")  # only the OTEL_* variables turn it on
    except SettingsError as e:
        print(f"tandem draft: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.common.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        asyncio.run(run(settings))
    except OSError as e:  # e.g. the port is taken
        logger.error("draft worker failed to start: %s", e)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
