"""The cancellation soak (issue 11, acceptance 2), shared by the test and the benchmark script.

    run_soak(cluster, n)   n streamed completions, `concurrency` in flight; about half are
                           cancelled by the client (it closes its connection, as a Ctrl-C would)
                           at a random moment of one of three kinds:
                             before   a few ms after sending: admission, tokenizing, Reserve
                             prefill  before the first token, part way into a long prompt
                             decode   after a random number of streamed tokens
                           the rest must complete with every token.
    then                   poll until every prefill and decode pool is idle at its baseline and
                           every draft worker holds no sequence,
                           measuring how long that took after the last request ended, and ask
                           every worker (draft too) for check_integrity() over GetLoad.

The moment a cancel really hit is recorded from what the client had seen (no token yet, or some).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import async_rest, draft_sequences, integrity_errors, kv_usage, random_prompts

MOMENTS = ("before", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class Plan:
    prompt: list[int]
    max_tokens: int
    cancel: str | None  # one of MOMENTS, or None: run to the end
    delay_s: float = 0.0  # before / prefill: cancel this long after sending
    after_tokens: int = 0  # decode: close the stream once this many tokens arrived


@dataclass
class SoakResult:
    num_requests: int
    planned: Counter = field(default_factory=Counter)
    """Cancels planned per moment."""
    observed: Counter = field(default_factory=Counter)
    """Cancels per what the client had seen: 'no token' or 'tokens'."""
    failures: list[str] = field(default_factory=list)
    """Requests not meant to be cancelled that did not complete in full."""
    settle_s: float = 0.0
    """From the last request's end until every pool was idle at its baseline."""
    integrity: dict[str, str] = field(default_factory=dict)
    """worker -> check_integrity() violation ("" = intact), after settling."""
    baseline: dict[str, int] = field(default_factory=dict)
    final: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def num_cancelled(self) -> int:
        return sum(self.planned.values())


def make_plans(n: int, seed: int, vocab: int = 1024, cancel_fraction: float = 0.5) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        cancel = rng.choice(MOMENTS) if rng.random() < cancel_fraction else None
        # prefill cancels need prompts long enough to be cut part way (several 32-token chunks),
        # decode cancels outputs long enough that the cut lands before the end
        length = rng.randint(160, 300) if cancel == "prefill" else rng.randint(8, 120)
        prompt = random_prompts([length], seed=seed * 100_003 + i, vocab=vocab)[0]
        max_tokens = rng.randint(64, 160) if cancel == "decode" else rng.randint(4, 24)
        if cancel == "before":
            plans.append(Plan(prompt, max_tokens, cancel, delay_s=rng.uniform(0.0, 0.01)))
        elif cancel == "prefill":
            plans.append(Plan(prompt, max_tokens, cancel, delay_s=rng.uniform(0.01, 0.2)))
        elif cancel == "decode":
            plans.append(Plan(prompt, max_tokens, cancel, after_tokens=rng.randint(1, 48)))
        else:
            plans.append(Plan(prompt, max_tokens, None))
    return plans


async def _stream(client: httpx.AsyncClient, plan: Plan, seen: list[int], sent: asyncio.Event) -> str:
    """One streamed completion: "done" ([DONE] after max_tokens tokens), "cut" (a decode cancel
    closed the connection after its tokens), or "short" (ended early)."""
    body = {"prompt": plan.prompt, "max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}  # one event may carry several tokens (accepted drafts)

    async def on_request(request: httpx.Request) -> None:
        sent.set()  # the request leaves now: "before" and "prefill" delays count from here

    client.event_hooks["request"] = [on_request]
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return "done" if len(seen) == plan.max_tokens else "short"
            if line.startswith("data: ") and (choices := json.loads(line[6:]).get("choices")):
                seen.extend(t for c in choices for t in c.get("token_ids") or ())
                if plan.cancel == "decode" and len(seen) >= plan.after_tokens:
                    return "cut"  # leaving the block closes the connection mid-stream
    return "short"


async def _one(client: httpx.AsyncClient, plan: Plan, result: SoakResult) -> None:
    seen: list[int] = []
    sent = asyncio.Event()
    task = asyncio.create_task(_stream(client, plan, seen, sent))
    if plan.cancel is not None:
        result.planned[plan.cancel] += 1
    if plan.cancel in ("before", "prefill"):
        waiter = asyncio.create_task(sent.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await asyncio.wait({task}, timeout=plan.delay_s)
        result.observed["completed first" if task.done() else "tokens" if seen else "no token"] += 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    try:
        outcome = await task
    except Exception as e:  # noqa: BLE001 - counted, reported by the caller
        result.failures.append(f"{len(plan.prompt)}-token prompt: {type(e).__name__}: {e}")
        return
    if plan.cancel == "decode":
        result.observed["tokens" if outcome == "cut" else "completed first"] += 1
    elif outcome != "done":
        result.failures.append(f"{len(plan.prompt)}-token prompt: {len(seen)}/{plan.max_tokens} tokens")


def idle_at_baseline(cluster: Cluster, baseline: dict[str, int]) -> dict[str, int] | None:
    usage = kv_usage(cluster)
    if all(u.idle and u.used <= baseline[name] for name, u in usage.items()) and not any(draft_sequences(cluster).values()):
        return {name: u.used for name, u in usage.items()}
    return None


def run_soak(cluster: Cluster, num_requests: int, *, concurrency: int = 16, seed: int = 0,
             settle_timeout_s: float = 120.0) -> SoakResult:  # fmt: skip
    """Runs the soak against a running cluster (see the module doc); raises if the pools never
    settle within settle_timeout_s (a generous bound: the measured time is in the result)."""
    usage = kv_usage(cluster)
    assert all(u.idle for u in usage.values()), f"the cluster is not idle before the soak: {usage}"
    result = SoakResult(num_requests, baseline={name: u.used for name, u in usage.items()})
    plans = make_plans(num_requests, seed)

    async def main() -> None:
        gate = asyncio.Semaphore(concurrency)

        async def gated(plan: Plan) -> None:
            # A client (connection pool) per request: a pool shared by hundreds of cancelled
            # streams leaked its slots (httpcore), and the soak stalled after ~550 requests.
            async with gate, async_rest(cluster, timeout=300.0) as client:
                try:
                    async with asyncio.timeout(600.0):  # a hung client fails the soak, never stalls it
                        await _one(client, plan, result)
                except TimeoutError:
                    result.failures.append(f"{len(plan.prompt)}-token prompt: no answer in 600 s (cancel={plan.cancel})")

        await asyncio.gather(*(gated(p) for p in plans))

    started = time.monotonic()
    asyncio.run(main())
    ended = time.monotonic()
    result.wall_s = ended - started
    deadline = ended + settle_timeout_s
    while (final := idle_at_baseline(cluster, result.baseline)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"KV never back to baseline {result.baseline} within {settle_timeout_s:.0f} s: "
                                 f"{kv_usage(cluster)}")  # fmt: skip
        time.sleep(0.02)
    result.settle_s = time.monotonic() - ended
    result.final = final
    result.integrity = integrity_errors(cluster)
    return result
