"""Garbage-collection pauses of `tandem up`'s processes under load, with start-up's heap frozen
(services/runtime/heap.py) and without (TANDEM_GC_FREEZE=0), in one run.

    python benchmarks/gc_pauses.py [--model tiny] [--streams 4] [--seconds 60] [--rounds 2]

Each arm starts `tandem up`'s defaults (aggregated, auto threads) afresh with the setting in its
services' environment and, from the moment it is ready, with no warm-up (a new replica's first
minute, as a rolling update or a scale-out gives it: the decode worker still loads its tokenizer in
the background), streams distinct 128-token prompts x 64 tokens from
--streams closed-loop client streams (benchmarks/stream_load.py's client) for --seconds. The arms alternate (on, off, off, on, ...).
Per arm: each service's collections during the load and the time they stopped it, from its own
`tandem_gc_pause_seconds` histogram (/metrics, scraped when the cluster is ready and after the
load), the largest pause (the bucket it fell in), and at the client TTFT
p50 / p99, the gaps between tokens p99 / max, output tok/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model, model_label, print_table, write_result  # noqa: E402
from benchmarks.serving_overhead import OUTPUT_LEN, prompts_for, served_cluster  # noqa: E402
from benchmarks.stream_load import run_streams, served_model  # noqa: E402
from services.runtime.heap import FREEZE_ENV  # noqa: E402

ARMS = {"frozen": "1", "not frozen": "0"}


def gc_histogram(text: str) -> dict[str, dict]:
    """generation -> {"count", "sum", "buckets": [(le, cumulative count)]} of tandem_gc_pause_seconds."""
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "tandem_gc_pause_seconds":
            continue
        for s in family.samples:
            g = out.setdefault(s.labels["generation"], {"count": 0.0, "sum": 0.0, "buckets": []})
            if s.name.endswith("_count"):
                g["count"] = s.value
            elif s.name.endswith("_sum"):
                g["sum"] = s.value
            elif s.name.endswith("_bucket"):
                g["buckets"].append((float(s.labels["le"]), s.value))
    return out


def scrape_all(cluster) -> dict[str, dict[str, dict]]:
    """role -> its gc histogram (one worker a role in the default cluster)."""
    out = {"gateway": gc_histogram(httpx.get(cluster.http_url + "/metrics", timeout=30).text)}
    for p in cluster.processes:
        if p.role != "gateway" and p.metrics_url:
            out[p.role] = gc_histogram(httpx.get(str(p.metrics_url), timeout=30).text)
    return out


def pauses_between(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Collections, total pause and the largest pause's bucket bound over the load."""
    total_s, counts, largest = 0.0, {}, 0.0
    for gen, a in after.items():
        b = before.get(gen, {"count": 0.0, "sum": 0.0, "buckets": [(le, 0.0) for le, _ in a["buckets"]]})
        counts[gen] = int(a["count"] - b["count"])
        total_s += a["sum"] - b["sum"]
        below = dict(b["buckets"])
        for le, n in sorted(a["buckets"]):  # the first bound holding every pause of the load
            if n - below.get(le, 0.0) >= a["count"] - b["count"]:
                if a["count"] > b["count"]:
                    largest = max(largest, le)
                break
    return {"collections": counts, "paused_ms": total_s * 1e3, "largest_pause_le_ms": largest * 1e3}


def client_load(url: str, model: Path, streams: int, seconds: float, seed: int) -> dict:
    """`streams` closed-loop streams of distinct prompts for `seconds` (stream_load's client)."""
    prompts = iter(prompts_for(model, 4000, seed))
    results, failed, start = run_streams(url, served_model(url), lambda: next(prompts), streams, seconds, OUTPUT_LEN)
    if not results:
        raise RuntimeError(f"no request finished ({failed} failed)")
    ttfts = [r.first - r.sent for r in results]
    gaps = [b - a for r in results for a, b in zip(r.arrivals, r.arrivals[1:])]
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e3  # noqa: E731
    wall = max(r.last for r in results) - start
    return {"requests": len(results), "failed": failed, "ttft_p50_ms": statistics.median(ttfts) * 1e3,
            "ttft_p99_ms": q(ttfts, 99), "gap_p99_ms": q(gaps, 99), "gap_max_ms": max(gaps) * 1e3,
            "output_tok_s": sum(r.tokens for r in results) / wall}  # fmt: skip


def run_arm(model: Path, freeze: str, streams: int, seconds: float, seed: int) -> dict:
    old = os.environ.get(FREEZE_ENV)
    os.environ[FREEZE_ENV] = freeze  # the services inherit it
    try:
        with served_cluster(model) as cluster:
            before = scrape_all(cluster)  # from readiness: what a new replica's first requests meet
            gc.collect()
            gc.freeze()  # this client's own heap (torch, transformers) out of its collections too
            client = client_load(cluster.http_url, model, streams, seconds, seed)
            after = scrape_all(cluster)
    finally:
        if old is None:
            os.environ.pop(FREEZE_ENV, None)
        else:
            os.environ[FREEZE_ENV] = old
    return {"client": client, "services": {role: pauses_between(before[role], after[role]) for role in after}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="gc_pauses")
    args = ap.parse_args()
    model = bench_model(args.model)
    names = list(ARMS)
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for arm in names if rnd % 2 == 0 else names[::-1]:
            result = run_arm(model, ARMS[arm], args.streams, args.seconds, seed=100 * rnd)
            result.update(arm=arm, round=rnd)
            runs.append(result)
            print(json.dumps(result), flush=True)
    rows = []
    for r in runs:
        c = r["client"]
        row = [r["round"], r["arm"]]
        for role in ("gateway", "decode"):
            s = r["services"].get(role, {})
            row += [s.get("collections", {}).get("2", 0), f"{s.get('paused_ms', 0):.0f}", f"{s.get('largest_pause_le_ms', 0):g}"]
        row += [f"{c['ttft_p50_ms']:.1f}", f"{c['ttft_p99_ms']:.1f}", f"{c['gap_p99_ms']:.1f}", f"{c['gap_max_ms']:.0f}",
                f"{c['output_tok_s']:.0f}"]  # fmt: skip
        rows.append(row)
    table = print_table(
        f"GC pauses of `tandem up` ({model_label(args.model)}, {args.streams} streams x {args.seconds:g} s, 128-token "
        "prompts x 64 tokens): start-up's heap frozen or not",
        ["round", "heap", "gateway full GCs", "gateway paused ms", "gateway largest <= ms", "decode full GCs",
         "decode paused ms", "decode largest <= ms", "TTFT p50 ms", "TTFT p99 ms", "gap p99 ms", "gap max ms", "tok/s"],
        rows)  # fmt: skip
    write_result(args.name, {"model": args.model, "streams": args.streams, "seconds": args.seconds, "runs": runs,
                             "table": table})  # fmt: skip


if __name__ == "__main__":
    main()
