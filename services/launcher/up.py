"""`tandem up`: start a whole local cluster and keep it running until Ctrl-C / SIGTERM.

    tandem up --model models/default [--mode disaggregated] [--decode 2] [--num-kv-blocks 512] ...

1. Redis: --redis-url / REDIS_URL, else a private redis-server (stopped with the cluster).
2. Every service as its own process on free loopback ports (gateway on --port / --grpc-port),
   each logging to <run dir>/<role>-<i>.log; flags not listed below go to each service that has
   them (`tandem decode --help` etc. list them).
3. Wait until all are healthy and registered, print the endpoints.
4. A service that dies later is restarted (same ports) after a backoff of --restart-backoff
   seconds, doubling per quick death up to --restart-backoff-max; the others keep serving
   (services/launcher/healing.py). After --restart-limit deaths in a row (0: at the first), or
   a death during startup: stop everything, print the tail of its log, exit 1.
   With --standby-gateway (the default), a warm standby gateway waits beside the gateway, its
   imports, tokenizer and Redis done but no port bound; when the gateway dies it binds the
   gateway's ports and serves within a second (services/launcher/standby.py).
5. On SIGINT/SIGTERM: SIGTERM every service (gateway first), wait --grace seconds, SIGKILL what
   is left, stop Redis.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from services.launcher.cluster import AUTO_THREADS, MODES, Cluster, ClusterSpec, LaunchError, launch
from services.launcher.healing import HealEvent, RestartPolicy
from services.launcher.readiness import StartupError
from services.launcher.supervisor import tail
from services.runtime import settings as service_settings
from services.runtime.redis_server import RedisServerError

CHILD_POLL_S = 0.5


class _Interrupted(BaseException):
    """SIGINT/SIGTERM arrived: unwind to the stop path (a BaseException, like KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem up", allow_abbrev=False,  # so --prefill-chunk-size is never read as --prefill
        description="Start a local Tandem cluster: Redis (if needed), prefill, decode, draft, gateway.",
        epilog="Any other flag of `tandem gateway|prefill|decode|draft` (e.g. --num-kv-blocks, "
               "--max-num-batched-tokens, --device, --dtype, --prefill-chunk-size, --log-level) is "
               "passed to every service that has it.",
    )  # fmt: skip
    add = parser.add_argument
    add("--model", required=True, help="model folder (config.json, weights, tokenizer)")
    add("--draft-model", default=None, help="draft model folder: also start a draft worker and "
        "make decode speculate with it")
    add("--draft-weight-dtype", default=None, choices=service_settings.WEIGHT_DTYPES,
        help="the draft worker's --weight-dtype alone (e.g. bfloat16: a float32 draft streaming half "
        "the bytes, while the target keeps its own weights; a plain --weight-dtype goes to every "
        "engine service)")
    add("--mode", default="aggregated", choices=MODES, help="default: aggregated (one box: the decode "
        "worker prefills too); disaggregated adds prefill workers that ship KV to decode")
    add("--prefill", type=int, default=None, help="prefill workers (default 1; 0 in aggregated mode)")
    add("--decode", type=int, default=1, help="decode workers (default 1)")
    add("--host", default="127.0.0.1", help="gateway bind address (workers stay on loopback)")
    add("--port", type=int, default=8000, help="gateway HTTP port, 0 = any free (default 8000)")
    add("--grpc-port", type=int, default=50051, help="gateway gRPC port, 0 = any free (default 50051)")
    add("--redis-url", default=os.environ.get("REDIS_URL") or None,
        help="use this Redis (default $REDIS_URL; unset: start a private redis-server)")
    add("--cluster", default=os.environ.get("TANDEM_CLUSTER") or "tandem",
        help="Redis key namespace (default $TANDEM_CLUSTER or 'tandem')")
    add("--api-key", action="append", default=None, help="an API key the gateway requires (repeatable; "
        "also $TANDEM_API_KEYS, or --api-key-file FILE); passed by env, never in a command line")
    add("--tls-dir", default=None, help="mTLS between all services (and TLS on the gateway's ports) "
        "with the files of `tandem certs --out DIR`; made there when DIR has no ca.crt")
    add("--torch-threads", type=_threads, default=AUTO_THREADS, help="torch threads per engine service "
        "(default auto: this machine's cores split evenly between the engine services)")
    add("--run-dir", default=None, help="folder for the services' logs (default .tandem/runs/<time>-<cluster>)")
    add("--startup-timeout", type=float, default=180.0, help="seconds to wait for readiness")
    add("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL on stop")
    policy = RestartPolicy()
    add("--restart-limit", type=int, default=policy.limit, help="restart a dead service at most this "
        f"many times in a row (a run of {policy.stable_s:.0f} s resets the count); then stop the cluster. "
        f"0: stop at the first death (default {policy.limit})")
    add("--restart-backoff", type=float, default=policy.backoff_s, help="seconds before the first "
        f"restart, doubling per quick death (default {policy.backoff_s:g})")
    add("--restart-backoff-max", type=float, default=policy.backoff_max_s,
        help=f"longest wait before a restart (default {policy.backoff_max_s:g})")
    add("--standby-gateway", action=argparse.BooleanOptionalAction, default=True,
        help="keep a warm standby gateway (loaded, connected, no port bound) that takes over within "
        "a second when the gateway dies, at the cost of one more gateway process (default on; "
        "needs --restart-limit > 0)")
    return parser


def _threads(value: str) -> int | str:
    if value == AUTO_THREADS:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of threads or {AUTO_THREADS!r}") from None


def spec_from_args(argv: Sequence[str]) -> ClusterSpec:
    args, extra = build_parser().parse_known_args(list(argv))
    try:
        restart = RestartPolicy(args.restart_limit, args.restart_backoff, args.restart_backoff_max)
    except ValueError as exc:
        raise LaunchError(f"--restart-*: {exc}") from None
    if args.draft_weight_dtype is not None and args.draft_model is None:
        raise LaunchError("--draft-weight-dtype needs --draft-model")
    service_args = {"draft": ("--weight-dtype", args.draft_weight_dtype)} if args.draft_weight_dtype else {}
    return ClusterSpec(
        model=args.model, draft_model=args.draft_model, mode=args.mode, num_prefill=args.prefill,
        num_decode=args.decode, host=args.host, http_port=args.port, grpc_port=args.grpc_port,
        redis_url=args.redis_url, cluster=args.cluster, torch_threads=args.torch_threads,
        extra_args=tuple(extra), run_dir=args.run_dir, startup_timeout_s=args.startup_timeout,
        grace_s=args.grace, restart=restart, api_keys=tuple(args.api_key or ()), tls_dir=args.tls_dir,
        standby_gateway=args.standby_gateway, service_args=service_args,
    )  # fmt: skip


def _raise_interrupted(signum: int, _frame: object) -> None:
    # Once: a second Ctrl-C, or the terminal's SIGINT relayed by a wrapper such as `timeout`, must
    # not interrupt the handling of the first (it printed a traceback after a clean stop); main's
    # finally keeps them ignored while it stops the cluster, then restores the handlers.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    raise _Interrupted(signum)


def _print_event(event: HealEvent) -> None:
    print(event.message, file=sys.stderr, flush=True)
    if event.kind in ("exited", "standby_exited", "standby_failed"):
        log_path = event.log_path or event.process.log_path
        print(f"--- last lines of {log_path} ---\n{tail(log_path, 10)}", file=sys.stderr, flush=True)


def _watch(cluster: Cluster) -> int:
    """Block until a signal (-> 0) or a service dies for good (-> 1); the healer restarts the rest."""
    while True:
        healer = cluster.healer
        dead = healer.gave_up if healer is not None else cluster.supervisor.first_dead()
        if dead is not None:
            print(f"tandem up: {dead.name} exited with code {dead.returncode}; stopping the cluster\n"
                  f"--- last lines of {dead.log_path} ---\n{dead.log_tail()}", file=sys.stderr)  # fmt: skip
            return 1
        time.sleep(CHILD_POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        spec = spec_from_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster: Cluster | None = None
    try:
        print(f"tandem up: starting {', '.join(spec.roles)} for {spec.model} ...", flush=True)
        cluster = launch(spec, on_event=_print_event)
        print(cluster.describe() + "\nPress Ctrl-C to stop.", flush=True)
        return _watch(cluster)
    except _Interrupted as exc:
        print(f"\ntandem up: {exc}: stopping the cluster", file=sys.stderr, flush=True)
        return 0
    except StartupError as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    except RedisServerError as exc:
        print(f"tandem up: Redis: {exc}", file=sys.stderr)
        return 1
    finally:
        # Further signals must not cut the stop short: stop_all is bounded by --grace anyway.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        if cluster is not None:
            codes = cluster.stop()
            print("tandem up: stopped " + ", ".join(f"{k} ({v})" for k, v in codes.items()), file=sys.stderr)
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
