"""`tandem decode`: one decode worker process, configured by flags and TANDEM_* env vars.

Runs until SIGTERM/SIGINT, then drains: health NOT_SERVING, deregistered, Reserve answers
DRAINING, in-flight requests get --drain-timeout seconds to finish, exit 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.decode.server import serve
from services.runtime.service_main import run_service


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("decode", argv, serve, lambda handle: handle.drain())


if __name__ == "__main__":
    raise SystemExit(main())
