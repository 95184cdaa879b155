"""Before / after a change, side by side: `tandem up` from two source trees at once, one client.

    python benchmarks/commit_ab.py [--before HEAD] [--after WORKTREE] [--requests 600] [--max-tokens 1]

On a shared 2-core machine the same cluster's TTFT drifts by 20-40% from one minute to the next
(other tenants, frequency), far more than most changes move it, so runs of the old and the new
code one after the other tell nothing. Here both run at once: `--before` (a commit, checked out
into a temporary git worktree) and `--after` (a commit, or this working tree by default) each
start `tandem up` on the tiny model from their own tree (`python -m services.cli up` with that
tree as its working directory), and one light client (a raw keep-alive HTTP connection to each
gateway, no HTTP library in the way) sends distinct 128-token prompts to both, alternating
request by request and which goes first, so drift falls on both alike. Reported: TTFT (the first
SSE chunk) and whole-request p50 / mean of each, and the median of the paired after / before
TTFT ratios. Writes benchmarks/results/<--name>.json and a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_common import bench_model, print_table, write_result  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def source_tree(ref: str | None) -> Iterator[Path]:
    """This working tree (ref None), or `ref` checked out into a temporary worktree."""
    if ref is None:
        yield ROOT
        return
    where = Path(tempfile.mkdtemp(prefix="tandem-ab-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True)  # fmt: skip
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], capture_output=True)
        shutil.rmtree(where, ignore_errors=True)


@contextlib.contextmanager
def cluster(tree: Path, model: Path, run_dir: Path, extra: list[str]) -> Iterator[int]:
    """`tandem up` run from `tree`; yields its HTTP port once /health says ok."""
    port = free_port()
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--port", str(port), "--grpc-port", "0",
           "--no-standby-gateway", "--run-dir", str(run_dir), *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = open(run_dir.with_suffix(".log"), "w")
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not health_ok(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tandem up from {tree} did not start (see {log.name})")
            time.sleep(0.5)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def health_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        return reply.startswith(b"HTTP/1.1 200") and b'"ok"' in reply
    except OSError:
        return False


class Client:
    """One keep-alive connection; a streamed completion returns (TTFT, whole request) in seconds."""

    def __init__(self, port: int, model: str) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.model = model

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()  # fmt: skip
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body)) + body  # fmt: skip
        start = time.perf_counter()
        self.sock.sendall(request)
        got, first = b"", None
        while True:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError("the gateway closed the connection")
            got += chunk
            if first is None and b"data: {" in got:
                first = time.perf_counter() - start
            if got.endswith(b"0\r\n\r\n") and b"data: [DONE]" in got:
                return first, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="HEAD", help="a commit (default HEAD)")
    ap.add_argument("--after", default=None, help="a commit (default: this working tree)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=600, help="requests to each cluster (the first 10 warm up)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--pause-s", type=float, default=0.01, help="between requests (one stream, as a user's)")
    ap.add_argument("--up-args", default="", help="extra flags of `tandem up` for both, one string")
    ap.add_argument("--name", default="commit_ab")
    args = ap.parse_args()
    model = bench_model(args.model)
    rng = random.Random(7)
    ways = ("before", "after")
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    with contextlib.ExitStack() as stack:
        runs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-ab-runs-")))
        ports = {}
        for way, ref in (("before", args.before), ("after", args.after)):
            tree = stack.enter_context(source_tree(ref))
            ports[way] = stack.enter_context(cluster(tree, model, runs / way, args.up_args.split()))
        clients = {w: Client(ports[w], model.name) for w in ways}
        for i in range(args.requests):
            for way in ways if i % 2 == 0 else ways[::-1]:
                prompt = [rng.randrange(3, 1000) for _ in range(128)]
                took = clients[way].complete(prompt, args.max_tokens)
                if i >= 10:
                    times[way].append(took)
                time.sleep(args.pause_s)
    stats = {}
    for way in ways:
        ttft = [t * 1e3 for t, _ in times[way]]
        whole = [w * 1e3 for _, w in times[way]]
        stats[way] = dict(ttft_p50_ms=statistics.median(ttft), ttft_mean_ms=statistics.mean(ttft),
                          ttft_p90_ms=statistics.quantiles(ttft, n=10)[-1], request_p50_ms=statistics.median(whole))
    paired = statistics.median(a[0] / b[0] for a, b in zip(times["after"], times["before"]))
    rows = [[way, ref or "working tree", s["ttft_p50_ms"], s["ttft_mean_ms"], s["ttft_p90_ms"], s["request_p50_ms"]]
            for (way, ref), s in zip((("before", args.before), ("after", args.after)), stats.values())]
    table = print_table(
        f"Before / after at once, {model.name}, one stream, {len(times['after'])} requests each, max_tokens "
        f"{args.max_tokens} (ms); paired TTFT after / before: median {paired:.3f}",
        ["", "tree", "TTFT p50", "TTFT mean", "TTFT p90", "request p50"], rows)  # fmt: skip
    write_result(args.name, {"before": args.before, "after": args.after or "working tree", "model": model.name,
                             "requests": len(times["after"]), "max_tokens": args.max_tokens, "stats": stats,
                             "paired_ttft_ratio_median": paired, "table": table})  # fmt: skip


if __name__ == "__main__":
    main()
