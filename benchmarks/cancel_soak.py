"""Cancellation soak (issue 11, acceptance 2): 1000 streamed completions against a `tandem up`-style
cluster, about half cancelled by the client at a random moment (before, during prefill, during
decode); then the time until every KV pool is back at its baseline, and check_integrity() on every
worker.

    python benchmarks/cancel_soak.py                       # 1000 requests, 1 prefill + 2 decode
    python benchmarks/cancel_soak.py -n 200 --draft        # with a draft worker (draft = target)

Needs a quiet machine for a meaningful settle time (the pass/fail checks do not). Writes
benchmarks/results/cancel_soak.json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench_common import model_dir, print_table, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.launcher.cluster import start_cluster  # noqa: E402
from tests.cluster.cancel_soak import run_soak  # noqa: E402
from tests.cluster.cluster_helpers import ENGINE_ARGS, PATIENT_DRAFT, PINNED_K  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--decode", type=int, default=2, help="decode workers")
    parser.add_argument("--draft", action="store_true", help="add a draft worker (draft = target)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model = model_dir("llama", "tiny")
    extra = ENGINE_ARGS + ((*PINNED_K, *PATIENT_DRAFT) if args.draft else ())
    with tempfile.TemporaryDirectory(prefix="cancel-soak-") as run_dir, start_cluster(
        model, draft_model=str(model) if args.draft else None, mode="disaggregated", num_prefill=1,
        num_decode=args.decode, http_port=0, grpc_port=0, extra_args=extra, run_dir=run_dir,
    ) as cluster:  # fmt: skip
        result = run_soak(cluster, args.requests, concurrency=args.concurrency, seed=args.seed)

    rows = [[m, result.planned[m]] for m in ("before", "prefill", "decode")]
    rows += [[f"observed: {k}", v] for k, v in sorted(result.observed.items())]
    rows += [["not cancelled, failed", len(result.failures)], ["wall time (s)", f"{result.wall_s:.1f}"],
             ["KV back to baseline after (s)", f"{result.settle_s:.3f}"]]  # fmt: skip
    print_table(f"cancellation soak: {result.num_cancelled} of {result.num_requests} cancelled", ["", "value"], rows)
    broken = {name: error for name, error in result.integrity.items() if error}
    print("check_integrity():", "clean on every worker" if not broken else broken)
    write_result("cancel_soak", {
        "requests": result.num_requests, "cancelled": dict(result.planned), "observed": dict(result.observed),
        "failures": result.failures, "settle_s": result.settle_s, "wall_s": result.wall_s,
        "baseline": result.baseline, "final": result.final, "integrity": result.integrity, "draft": args.draft,
    })  # fmt: skip
    return 0 if not result.failures and not broken else 1


if __name__ == "__main__":
    raise SystemExit(main())
