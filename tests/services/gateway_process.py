"""A real gateway in a process of its own, for the tests that SIGKILL it mid-request.

    python -m tests.services.gateway_process MODEL REDIS_URL CLUSTER [--pause-after-reserve]

Serves a disaggregated gateway (the settings of tests/services/gateway_helpers.py) and prints
`HTTP <port>` once it listens. --pause-after-reserve parks every request right after decode's
Reserve answer arrived (the orchestrator's `after_reserve` hook), before any Generate or Prefill
call is opened, and prints `RESERVED <internal id>`: the test kills the process there.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from services.gateway.main import serve
from tests.services.gateway_helpers import gateway_settings, served_model


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", type=Path)
    parser.add_argument("redis_url")
    parser.add_argument("cluster")
    parser.add_argument("--pause-after-reserve", action="store_true")
    args = parser.parse_args()
    settings = gateway_settings(args.model, args.redis_url, args.cluster, mode="disaggregated", prefill_chunk_size=16)
    handle = await serve(settings, http_port=0, grpc_port=0, model=served_model(args.model))
    if args.pause_after_reserve:
        async def park(internal_id: str) -> None:
            print(f"RESERVED {internal_id}", flush=True)
            await asyncio.Event().wait()  # until SIGKILL

        handle.gateway.orchestrator.after_reserve = park
    print(f"HTTP {handle.http_port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
