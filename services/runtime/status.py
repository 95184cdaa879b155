"""`tandem status [--json]`: the cluster as the registry in Redis sees it.

    ROLE     ID    ADDRESS          MODEL  KV USED/TOTAL   RUN  WAIT  QUEUED  AGE   SPEC ACC
    prefill  p-0   127.0.0.1:50061  tiny   0/512 (0%)        0     0       0  0.4s  -
    decode   d-0   127.0.0.1:50071  tiny   96/512 (19%)      3     1       0  0.2s  0.72 (2.9 tok)
    tandem up (pid 4242): decode-1 restarted 1x (exit codes -9), others running; gateway-0 standby ready (pid 4321)

The last line comes from `tandem up`'s launcher record (`{cluster}:launcher`), when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from services.runtime.registry import (
    DEFAULT_CLUSTER,
    EXTRA_PREFIX_HASHES,
    EXTRA_SPEC_ACCEPTANCE_RATE,
    EXTRA_SPEC_DRAFT_COST,
    EXTRA_SPEC_MEAN_ACCEPTED_LEN,
    Registry,
    RegistryError,
    Role,
    WorkerInfo,
    redact_url,
)

CLUSTER_ENV = "TANDEM_CLUSTER"
REDIS_URL_ENV = "REDIS_URL"

_COLUMNS = ("ROLE", "ID", "ADDRESS", "MODEL", "KV USED/TOTAL", "RUN", "WAIT", "QUEUED", "AGE", "SPEC ACC")
_RIGHT_ALIGNED = {"RUN", "WAIT", "QUEUED", "AGE"}


def _sorted(workers: Sequence[WorkerInfo]) -> list[WorkerInfo]:
    order = list(Role)
    return sorted(workers, key=lambda w: (order.index(w.role), w.worker_id))


def _spec(worker: WorkerInfo) -> str:
    rate = worker.extra.get(EXTRA_SPEC_ACCEPTANCE_RATE)
    if not isinstance(rate, (int, float)):
        return "-"
    text = f"{rate:.2f}"
    mean_len = worker.extra.get(EXTRA_SPEC_MEAN_ACCEPTED_LEN)
    if isinstance(mean_len, (int, float)):
        text += f" ({mean_len:.1f} tok)"
    cost = worker.extra.get(EXTRA_SPEC_DRAFT_COST)
    if isinstance(cost, (int, float)):
        text += f" c={cost:.2f}"  # near 1 or above: adaptive k has switched speculation off
    return text


def _kv(worker: WorkerInfo) -> str:
    if worker.kv_blocks_total == 0:
        return "-"
    return f"{worker.kv_blocks_used}/{worker.kv_blocks_total} ({worker.kv_usage:.0%})"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def worker_status_dict(worker: WorkerInfo, now: float) -> dict[str, Any]:
    """One worker in `--json` form: the record plus derived fields, prefix hashes as a count."""
    data = worker.to_dict()
    extra = dict(data.pop("extra"))
    hashes = extra.pop(EXTRA_PREFIX_HASHES, None)
    if isinstance(hashes, list):
        extra["num_prefix_hashes"] = len(hashes)
    data["extra"] = extra
    data["kv_blocks_used"] = worker.kv_blocks_used
    data["kv_usage"] = round(worker.kv_usage, 4)
    data["heartbeat_age_s"] = round(worker.age_s(now), 3)
    return data


def launcher_line(doc: dict[str, Any]) -> str:
    """One line on what `tandem up`'s healer did: restarts per service, what is down."""
    services = doc.get("services")
    notes, standbys = [], []
    for name, info in sorted(services.items() if isinstance(services, dict) else []):
        if not isinstance(info, dict):
            continue
        restarts, state = info.get("restarts") or 0, str(info.get("state", "?"))
        codes = " ".join(str(c) for c in info.get("exit_codes") or [])
        standby = info.get("standby") if isinstance(info.get("standby"), dict) else None
        note = f"{name} restarted {restarts}x (exit codes {codes})" if restarts else name
        if standby is not None and standby.get("takeovers"):
            note += f", {standby['takeovers']}x by its standby"
        if state != "running":
            note += f", {state.replace('_', ' ')}" + ("" if restarts else f" (exit codes {codes})")
        if restarts or state != "running":
            notes.append(note)
        if standby is not None:
            pid = standby.get("pid")
            standbys.append(f"{name} standby {standby.get('state', '?')}" + (f" (pid {pid})" if pid else ""))
    summary = "; ".join(notes) + ", others running" if notes else "every service running, no restarts"
    return f"tandem up (pid {doc.get('launcher_pid')}): {summary}" + "".join(f"; {s}" for s in standbys)


def render_status(
    workers: Sequence[WorkerInfo],
    as_json: bool,
    *,
    now: float | None = None,
    cluster: str | None = None,
    launcher: dict[str, Any] | None = None,
) -> str:
    """The workers as an aligned text table, or as JSON: {"cluster", "workers": [...], counts}."""
    now = time.time() if now is None else now
    ordered = _sorted(workers)
    if as_json:
        counts = {role.value: sum(1 for w in ordered if w.role == role) for role in Role}
        doc = {
            "cluster": cluster,
            "num_workers": len(ordered),
            "workers_by_role": counts,
            "workers": [worker_status_dict(w, now) for w in ordered],
        }
        if launcher is not None:
            doc["launcher"] = launcher
        return json.dumps(doc, indent=2, sort_keys=False)
    header = f"cluster {cluster!r}: " if cluster is not None else ""
    footer = [launcher_line(launcher)] if launcher is not None else []
    if not ordered:
        return "\n".join([f"{header}no workers registered", *footer])
    rows = [
        (
            w.role.value, w.worker_id, w.address, w.model, _kv(w), str(w.num_running),
            str(w.num_waiting), str(w.queued_tokens), _age(w.age_s(now)), _spec(w),
        )
        for w in ordered
    ]
    widths = [max(len(col), *(len(row[i]) for row in rows)) for i, col in enumerate(_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(width) if col in _RIGHT_ALIGNED else cell.ljust(width)
            for col, cell, width in zip(_COLUMNS, cells, widths)
        ]
        return "  ".join(parts).rstrip()

    summary = ", ".join(
        f"{n} {role.value}" for role in Role if (n := sum(1 for w in ordered if w.role == role))
    )
    return "\n".join([f"{header}{summary}", line(_COLUMNS), *(line(row) for row in rows), *footer])


def main(argv: Sequence[str] | None = None) -> int:
    """`tandem status`: print the registry; exit 1 with a clear message when Redis is unreachable."""
    parser = argparse.ArgumentParser(prog="tandem status", description="Show the workers of a Tandem cluster.")
    parser.add_argument("--redis-url", default=None, help=f"Redis server (default: ${REDIS_URL_ENV})")
    parser.add_argument("--cluster", default=None,
                        help=f"cluster namespace (default: ${CLUSTER_ENV} or {DEFAULT_CLUSTER!r})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    redis_url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    if not redis_url:
        print(f"tandem status: no Redis to read: pass --redis-url or set {REDIS_URL_ENV} "
              "(`tandem up` prints the URL of the Redis server it started)", file=sys.stderr)
        return 2
    cluster = args.cluster or os.environ.get(CLUSTER_ENV) or DEFAULT_CLUSTER
    try:
        with Registry(redis_url, cluster) as registry:
            workers = registry.list_workers()
            try:
                launcher = registry.get_launcher()
            except RegistryError:  # a bad record must not hide the workers
                launcher = None
    except (RegistryError, ValueError) as exc:
        print(f"tandem status: cannot read cluster {cluster!r} at {redact_url(redis_url)}: {exc}", file=sys.stderr)
        return 1
    print(render_status(workers, args.json, cluster=cluster, launcher=launcher))
    return 0


if __name__ == "__main__":
    sys.exit(main())
