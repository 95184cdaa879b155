"""py-spy on every Tandem process while one client streams requests back to back (issue 10).

    pip install py-spy   # a profiler, not a dependency of Tandem
    python benchmarks/profile_serving.py [--model tiny] [--seconds 12] [--out /tmp/tandem-profile]

Starts `tandem up`'s defaults (aggregated, auto threads), streams serving_overhead's workload
(distinct 128-token prompts x 64 tokens, or --max-tokens) back to back from a thread of this process, records each service for --seconds with `py-spy record --threads
-f raw`, and prints each process's busiest threads and functions (self and inclusive samples).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_common import bench_model  # noqa: E402
from benchmarks.serving_overhead import OUTPUT_LEN, prompts_for  # noqa: E402
from services.launcher.cluster import AUTO_THREADS, start_cluster  # noqa: E402

ROLES = ("decode", "prefill", "draft", "gateway")


def stream_forever(url: str, model: Path, stop: threading.Event, max_tokens: int = OUTPUT_LEN) -> None:
    import httpx

    with httpx.Client(timeout=600) as client:
        for seed in itertools.count():
            for prompt in prompts_for(model, 256, seed):  # distinct: no prefix-cache hits
                if stop.is_set():
                    return
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True}  # fmt: skip
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        pass


def summarise(raw: Path, top: int = 20) -> str:
    """Busiest threads, then functions by self and inclusive samples, of a py-spy raw file."""
    total, threads, own, inclusive = 0, collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        own[(frames[0], frames[-1])] += n
        for frame in set(frames[1:]):
            inclusive[(frames[0], frame)] += n
    lines = [f"{raw.stem}: {total} samples"]
    lines += [f"  {n / total:6.1%}  {t}" for t, n in threads.most_common(8)]
    lines += ["  self:"] + [f"  {n / total:6.1%}  {t[:28]}  {f}" for (t, f), n in own.most_common(top)]
    lines += ["  inclusive:"] + [f"  {n / total:6.1%}  {t[:28]}  {f}" for (t, f), n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny, small or a fetch-model name")
    ap.add_argument("--seconds", type=int, default=12)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--out", type=Path, default=Path("/tmp/tandem-profile"))
    ap.add_argument("--max-tokens", type=int, default=OUTPUT_LEN,
                    help="output tokens a request (1: what each request costs besides its tokens, as TTFT sees it)")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    import psutil

    path = bench_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with start_cluster(str(path), mode="aggregated", torch_threads=AUTO_THREADS, http_port=0, grpc_port=0,
                       startup_timeout_s=600) as cluster:  # fmt: skip
        client = threading.Thread(target=stream_forever, args=(cluster.http_url, path, stop, args.max_tokens))
        client.start()
        time.sleep(3)  # past the first request's warm-up
        recorders = []
        for proc in psutil.Process().children(recursive=True):
            cmd = " ".join(proc.cmdline())
            role = next((r for r in ROLES if f"services.cli {r}" in cmd), None)
            if role is not None:
                raw = args.out / f"{role}-{proc.pid}.txt"
                recorders.append((raw, subprocess.Popen(
                    [spy, "record", "-p", str(proc.pid), "-d", str(args.seconds), "-r", str(args.rate), "-f", "raw",
                     "-o", str(raw), "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))  # fmt: skip
        for _, rec in recorders:
            rec.wait()
        stop.set()
        client.join()
    for raw, _ in recorders:
        if raw.exists():
            print(summarise(raw))


if __name__ == "__main__":
    main()
