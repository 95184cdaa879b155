"""Load for benchmarks/serve_vs_peers.py: N closed-loop streams of /v1/completions at a server.

Two clients measure the same three numbers per concurrency level, so either can fill the table:

- guidellm (the default of the full run): `guidellm benchmark run` with a concurrent profile and
  synthetic data of fixed prompt/output token counts, tokenized locally; its JSON is read back.
- builtin (`--client builtin`, and the smoke test: no guidellm needed): asyncio + httpx, each
  stream sends its next request the moment the previous one ends, until the level's time is up.

Per request: TTFT = first streamed text - request sent; ITL = (last token - first token) / (tokens
- 1), as guidellm defines it. Per level: output tokens/s = output tokens of the requests that
finished / time from the level's start to the last of them; TTFT and ITL are medians over requests.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

CORPUS = Path(__file__).resolve().parents[1] / "common" / "models" / "tokenizer_corpus.txt"


@dataclass(frozen=True)
class LevelResult:
    streams: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    requests: int  # finished requests the figures are over
    client: str
    failed: int = 0  # requests that errored or got no answer (not in the figures)
    ttft_p90_ms: float = math.nan  # the tail, where a held-back first token shows (not the p50)
    ttft_mean_ms: float = math.nan
    seed: int | None = None  # the prompts' seed, where the client draws them from one (guidellm)
    attempt: int = 1  # 2: the first run of the level hung and was killed (run_guidellm)

    def to_dict(self) -> dict:
        return asdict(self)


class PromptMaker:
    """Distinct prompts of exactly `num_tokens` tokens under the model's own tokenizer (distinct, so
    no server gets prefix-cache hits that the others don't)."""

    def __init__(self, model_dir: Path, num_tokens: int, seed: int = 0):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.num_tokens = num_tokens
        self.rng = random.Random(seed)
        self.words = [w for w in CORPUS.read_text().split() if w.isascii() and w.isalpha()]
        self.pool: list[str] = []

    def prepare(self, n: int) -> None:
        """Makes n prompts ahead, so tokenizing them doesn't stall the client while it measures."""
        self.pool = [self.make() for _ in range(n)]

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def make(self) -> str:
        if self.pool:
            return self.pool.pop()
        for _ in range(100):
            text = " ".join(self.rng.choices(self.words, k=self.num_tokens * 2))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.num_tokens]
            text = self.tokenizer.decode(ids)
            if self._count(text) == self.num_tokens:
                return text
        raise RuntimeError(f"no {self.num_tokens}-token prompt found in 100 tries")


def served_model(url: str) -> str:
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


@dataclass
class StreamedRequest:
    """One streamed completion as the client saw it (perf_counter seconds)."""

    sent: float
    arrivals: list[float]  # each chunk that carried text
    tokens: int  # output tokens (the usage block's count; chunks where the server sent none)

    @property
    def first(self) -> float:
        return self.arrivals[0]

    @property
    def last(self) -> float:
        return self.arrivals[-1]


async def _one_request(client: httpx.AsyncClient, url: str, body: dict) -> StreamedRequest | None:
    """One streamed completion; None if it failed or streamed no text."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    if not arrivals:
        return None
    # Usage counts tokens exactly; a chunk may carry several tokens, so chunks are only a fallback.
    return StreamedRequest(sent, arrivals, usage_tokens or len(arrivals))


def run_streams(url: str, model: str, next_prompt: Callable[[], str | list[int]], streams: int, duration_s: float,
                output_tokens: int) -> tuple[list[StreamedRequest], int, float]:  # fmt: skip
    """`streams` closed-loop streams, each sending its next prompt (text or token ids) the moment the
    last request ends, until `duration_s` is up. (finished requests, failed requests, start time)."""
    results: list[StreamedRequest] = []
    failures = [0]
    start = time.perf_counter()
    deadline = start + duration_s

    async def stream(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            body = {"model": model, "prompt": next_prompt(), "max_tokens": output_tokens, "temperature": 0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
            try:
                got = await _one_request(client, url, body)
            except httpx.TransportError:  # e.g. a keep-alive connection the server had closed
                got = None
            if got is None:
                failures[0] += 1
            else:
                results.append(got)

    async def level() -> None:
        limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            await asyncio.gather(*(stream(client) for _ in range(streams)))

    asyncio.run(level())
    return results, failures[0], start


def run_builtin(url: str, model_dir: Path, streams: int, duration_s: float, prompt_tokens: int,
                output_tokens: int, seed: int = 0) -> LevelResult:  # fmt: skip
    prompts = PromptMaker(model_dir, prompt_tokens, seed)
    model = served_model(url)
    prompts.prepare(min(512, max(32, int(streams * duration_s))))
    results, failed, start = run_streams(url, model, prompts.make, streams, duration_s, output_tokens)
    if not results:
        raise RuntimeError(f"no request finished at {streams} streams ({failed} failed)")
    tokens = sum(r.tokens for r in results)
    elapsed = max(r.last for r in results) - start
    ttfts = [(r.first - r.sent) * 1e3 for r in results]
    itls = [(r.last - r.first) * 1e3 / (r.tokens - 1) for r in results if r.tokens > 1]
    itl = statistics.median(itls) if itls else float("nan")
    p90 = statistics.quantiles(ttfts, n=10)[-1] if len(ttfts) > 1 else ttfts[0]
    return LevelResult(streams, tokens / elapsed, statistics.median(ttfts), itl, len(results), "builtin", failed,
                       ttft_p90_ms=p90, ttft_mean_ms=statistics.fmean(ttfts))  # fmt: skip


HANG_GRACE_S = 240.0  # past 4x its duration, this much longer and a guidellm level counts as hung


def run_guidellm(guidellm: Path, url: str, model_dir: Path, streams: int, duration_s: float,
                 prompt_tokens: int, output_tokens: int, out_prefix: Path, seed: int = 42) -> LevelResult:  # fmt: skip
    """One level as one `guidellm run` (concurrent profile), its tokenizer the model folder (no
    hub), its synthetic prompts drawn from `seed`, the figures read back from its JSON. guidellm 0.8.1 now and then never returns after a
    level (seen once in ~5 runs: every process idle, the server done): a run past its time limit
    is killed and tried once more, on fresh prompts (retry_seed): the killed run had already sent
    the first seed's prompts, and a server with a prompt cache answered them again from it (a
    retried level of llama-server on SmolLM2 read a TTFT p50 of 21.6 ms against ~140 cold)."""
    prefix = out_prefix.with_name(f"{out_prefix.name}-s{streams}")
    model = served_model(url)
    for attempt in (1, 2):
        level_seed = retry_seed(seed, attempt)
        report = _guidellm_level(guidellm, url, model, model_dir, streams, duration_s, prompt_tokens, output_tokens,
                                 prefix, level_seed, timeout_s=4 * duration_s + HANG_GRACE_S)  # fmt: skip
        if report is not None:
            (level,) = parse_guidellm(report)
            return replace(level, seed=level_seed, attempt=attempt)
        print(f"   guidellm hung at {streams} stream(s) (attempt {attempt}); killed", flush=True)
    raise RuntimeError(f"guidellm hung twice at {streams} streams; see {prefix}.guidellm.log")


def retry_seed(seed: int, attempt: int) -> int:
    """The prompts' seed of a level's `attempt`-th run: the level's own at first, then others that no
    level draws (level seeds are 1000 apart: serve_vs_peers.level_seed), so a retry is as cold as
    the run it replaces."""
    return seed + 500 * (attempt - 1)


def _guidellm_level(guidellm: Path, url: str, model: str, model_dir: Path, streams: int, duration_s: float,
                    prompt_tokens: int, output_tokens: int, prefix: Path, seed: int,
                    timeout_s: float) -> dict | None:  # fmt: skip
    """guidellm's report of one level, or None when it ran past timeout_s (then killed, with its workers)."""
    out = prefix.with_suffix(".guidellm.json")
    out.unlink(missing_ok=True)
    spec = {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "http2": False, "timeout": 600},
        "profile": {"kind": "concurrent", "streams": [streams]},
        "constraint": {"kind": "max_duration", "seconds": duration_s},
        "data": {"kind": "synthetic_text", "prompt_tokens": prompt_tokens, "output_tokens": output_tokens},
        "tokenizer": {"kind": "huggingface_auto", "model": str(model_dir)},
        "output": {"kind": "json", "path": str(out)},
        "seed": {"kind": "static", "value": seed},
    }  # fmt: skip
    argv = [str(guidellm), "run", "--disable-console-interactive"]
    for flag, value in spec.items():
        argv += [f"--{flag}", json.dumps(value)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = prefix.with_suffix(".guidellm.log")
    with log.open("w") as f:
        f.write(" ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # guidellm and its worker processes, nothing else
            proc.wait()
            return None
    if code or not out.exists():
        tail = " | ".join(log.read_text(errors="replace").splitlines()[-12:])
        raise RuntimeError(f"guidellm exited {code}: {tail[-2000:]}")
    return json.loads(out.read_text())


def parse_guidellm(report: dict) -> list[LevelResult]:
    """One LevelResult per sub-benchmark, guidellm's own figures: output tokens/s over the level
    (every token received, as its console reports it), and the medians of its per-request TTFT and
    ITL over the finished requests (its ITL per request is the builtin client's definition)."""
    levels = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        streams = bench["config"]["strategy"]["streams"]
        done = m["request_totals"]["successful"]
        if not done:
            raise RuntimeError(f"no request finished at {streams} streams ({m['request_totals']}): guidellm cancels "
                               "the requests still running when the level's time is up; a longer --duration helps")
        levels.append(LevelResult(
            streams=streams,
            output_tok_s=m["output_tokens_per_second"]["total"]["mean"],
            ttft_p50_ms=m["time_to_first_token_ms"]["successful"]["median"],
            ttft_p90_ms=m["time_to_first_token_ms"]["successful"]["percentiles"]["p90"],
            ttft_mean_ms=m["time_to_first_token_ms"]["successful"]["mean"],
            itl_p50_ms=m["inter_token_latency_ms"]["successful"]["median"],
            requests=done,
            client="guidellm",
            failed=m["request_totals"]["errored"],
        ))  # fmt: skip
    return levels
