"""Acceptance 3: 32 concurrent streaming requests over 2 decode workers all complete, and both
workers took a share (each decode's received KV bytes grew), with every KV pool back to its
baseline afterwards."""

from __future__ import annotations

import asyncio

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import (async_openai_client, kv_usage, random_prompts, served_model, wait_for,
                                           worker_metrics)  # fmt: skip

NUM_REQUESTS = 32
RECV = 'tandem_kv_transfer_bytes_total{direction="recv"}'


async def _stream_all(cluster: Cluster, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, int]]:
    client = async_openai_client(cluster, timeout=180)
    model = served_model(cluster)

    async def one(prompt: list[int]) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        finish, tokens = "", 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return finish, tokens

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def test_32_concurrent_streams_use_both_decode_workers(disagg: Cluster) -> None:
    assert len(disagg.workers("decode")) == 2
    baseline = {name: u.used for name, u in kv_usage(disagg).items()}
    before = [m.get(RECV, 0.0) for m in worker_metrics(disagg, "decode")]
    prompts = random_prompts([20 + 3 * i for i in range(NUM_REQUESTS)], seed=3)

    results = asyncio.run(_stream_all(disagg, prompts, max_tokens=12))

    assert results == [("length", 12)] * NUM_REQUESTS
    after = [m.get(RECV, 0.0) for m in worker_metrics(disagg, "decode")]
    shares = [a - b for a, b in zip(after, before)]
    assert all(share > 0 for share in shares), f"KV bytes received per decode worker: {shares}"
    wait_for(lambda: all(u.idle and u.used <= baseline[n] for n, u in kv_usage(disagg).items()),
             what="every KV pool back to baseline")  # fmt: skip
