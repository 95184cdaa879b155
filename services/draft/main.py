"""`tandem draft --model DIR`: a draft worker process, configured by flags and TANDEM_* env vars.

Runs until SIGTERM/SIGINT, then drains: health NOT_SERVING, Propose refused (decode carries on
without speculation), deregistered, in-flight calls get --drain-timeout seconds, exit 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.draft.server import serve
from services.runtime.service_main import run_service


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("draft", argv, serve, lambda handle: handle.drain())


if __name__ == "__main__":
    raise SystemExit(main())
