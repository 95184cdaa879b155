"""What API keys + mTLS cost the cluster tests: CPU seconds per operation of the test helpers
(tests/cluster/cluster_helpers.py) against a plaintext and a secure cluster (aggregated: gateway +
decode), the test process and every service counted (their utime + stime), less what the cluster
burns idle over the same wall time (heartbeats, health loops: measured just before), so the figure
depends little on how loaded the machine is. Each operation opens a new connection, as the helpers do.

    python benchmarks/tls_overhead.py [-n 100]

    GET /health       get(cluster, "/health"): TCP (+ TLS handshake) + one request
    completion        complete_ids(cluster, prompt, max_tokens=4)
    worker GetLoad    get_load(decode): a new gRPC channel (+ mTLS handshake) + one call

Writes benchmarks/results/tls_overhead.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import model_dir, print_table, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.launcher.cluster import Cluster, start_cluster  # noqa: E402
from services.runtime import certs  # noqa: E402
from tests.cluster.cluster_helpers import ENGINE_ARGS, complete_ids, get, get_load, start_secure_cluster  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(cluster: Cluster) -> float:
    """utime + stime of this process and of every service of the cluster."""
    total = sum(os.times()[:2])
    for p in cluster.processes:
        fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15 of stat)
    return total


def idle_rate(cluster: Cluster, seconds: float = 10.0) -> float:
    """CPU seconds per wall second the cluster (and this process) use doing nothing."""
    cpu, wall = cpu_seconds(cluster), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(cluster) - cpu) / (time.monotonic() - wall)


def measure(cluster: Cluster, n: int) -> dict[str, float]:
    """CPU ms per operation of each helper operation, n times each (after warm-up), idle CPU taken out."""
    decode = cluster.service("decode")
    ops: dict[str, Callable[[], object]] = {
        "GET /health": lambda: get(cluster, "/health", timeout=60),
        "completion": lambda: complete_ids(cluster, [11, 12, 13, 14, 15], max_tokens=4),
        "worker GetLoad": lambda: get_load(decode),
    }
    for op in ops.values():
        for _ in range(5):
            op()
    out = {}
    for name, op in ops.items():
        idle = idle_rate(cluster)
        cpu, wall = cpu_seconds(cluster), time.monotonic()
        for _ in range(n):
            op()
        out[name] = 1000 * (cpu_seconds(cluster) - cpu - idle * (time.monotonic() - wall)) / n
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100, help="operations of each kind")
    args = parser.parse_args()
    model = model_dir("llama", "tiny")
    results = {}
    with tempfile.TemporaryDirectory(prefix="tls-overhead-") as tmp:
        tls_dir = certs.write_certs(Path(tmp, "certs"))
        opts = dict(mode="aggregated", http_port=0, grpc_port=0, extra_args=ENGINE_ARGS)
        for label, start in (("plaintext", lambda: start_cluster(model, run_dir=f"{tmp}/plain", **opts)),
                             ("keys + mTLS", lambda: start_secure_cluster(model, tls_dir, run_dir=f"{tmp}/secure", **opts))):
            with start() as cluster:
                results[label] = measure(cluster, args.n)
    plain, secure = results["plaintext"], results["keys + mTLS"]
    rows = [[op, f"{plain[op]:.1f}", f"{secure[op]:.1f}", f"{secure[op] - plain[op]:+.1f}"] for op in plain]
    print_table(f"CPU ms per operation (n = {args.n}, all processes)", ["", "plaintext", "keys + mTLS", "extra"], rows)
    write_result("tls_overhead", {"n": args.n, "cpu_ms_per_op": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
