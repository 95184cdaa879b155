"""`tandem decode`: one decode worker process, configured by flags and TANDEM_* env vars.

Runs until SIGTERM/SIGINT, then drains: health NOT_SERVING, Reserve answers DRAINING, in-flight
requests get a grace period to finish, the worker deregisters and exits.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.decode.server import DEFAULT_DRAIN_GRACE_S, serve
from services.runtime.service_main import run_service


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("decode", argv, serve, lambda handle: handle.drain(DEFAULT_DRAIN_GRACE_S))


if __name__ == "__main__":
    raise SystemExit(main())
