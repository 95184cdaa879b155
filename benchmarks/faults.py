"""The fault table of docs/reliability.md: 8 clients x 40 greedy requests against a `tandem up
--decode 2` cluster (1 prefill, 2 decode, 1 draft, gateway, its own Redis; healing on), one run
per fault: SIGKILL decode / prefill / draft / gateway, SIGSTOP decode for 30 s, Redis down 20 s.
The harness is tests/faults/fault_table.py (`make test` runs it reduced and asserts the counts).

    python benchmarks/faults.py [--clients 8] [--requests 40] [--freeze 30] [--redis-down 20]
                                [--faults sigkill-decode sigstop-decode ...] [--size tiny]
                                [--no-standby-gateway]   (cold gateway restarts, as before)

Prints the table and writes benchmarks/results/faults.json. Durations are as measured on this
machine (a shared one is slower to restart a service); the counts are the result.
"""

from __future__ import annotations

import argparse
import tempfile

from bench_common import model_dir, write_result
from services.launcher.cluster import start_cluster
from services.launcher.healing import RestartPolicy
from tests.faults.conftest import FAULT_ARGS
from tests.faults.fault_table import FAULTS, Load, format_table, run_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=40, help="per client")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--freeze", type=float, default=30.0, help="seconds decode-0 stays SIGSTOPped")
    parser.add_argument("--redis-down", type=float, default=20.0, help="seconds Redis stays down")
    parser.add_argument("--faults", nargs="*", default=list(FAULTS), choices=FAULTS)
    parser.add_argument("--size", default="tiny", help="model size (benchmarks/.models)")
    parser.add_argument("--standby-gateway", action=argparse.BooleanOptionalAction, default=True,
                        help="keep a warm standby gateway, as `tandem up` does (default on)")
    args = parser.parse_args()

    load = Load(clients=args.clients, requests_per_client=args.requests, max_tokens=args.max_tokens,
                freeze_s=args.freeze, redis_down_s=args.redis_down, settle_timeout_s=600.0)  # fmt: skip
    model = model_dir("llama", args.size)
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as run_dir, start_cluster(
        model, draft_model=str(model), num_prefill=1, num_decode=2, http_port=0, grpc_port=0, redis_url=None,
        extra_args=FAULT_ARGS, run_dir=run_dir, startup_timeout_s=600.0,
        restart=RestartPolicy(limit=10, backoff_s=0.5, backoff_max_s=5.0), standby_gateway=args.standby_gateway,
    ) as cluster:  # fmt: skip
        results = run_table(cluster, load, tuple(args.faults))
    table = format_table(results)
    print(table, flush=True)
    path = write_result("faults", {
        "load": {"clients": load.clients, "requests_per_client": load.requests_per_client,
                 "max_tokens": load.max_tokens, "freeze_s": load.freeze_s, "redis_down_s": load.redis_down_s,
                 "inject_after": load.inject_after},
        "cluster": "1 prefill, 2 decode, 1 draft, gateway" + (" + warm standby" if args.standby_gateway else "")
                   + "; " + " ".join(FAULT_ARGS),
        "results": [r.to_dict() for r in results], "table": table,
    })  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
