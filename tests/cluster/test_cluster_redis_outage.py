"""Acceptance 6: Redis stopped for a while, then restarted empty on the same port.

While Redis is down, in-flight streams finish and new requests are still routed (the gateway
uses its last known registry); after the restart every worker re-registers within a few
heartbeats and requests keep succeeding. The cluster has its own private Redis (the launcher's)."""

from __future__ import annotations

import asyncio
import time

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import (ENGINE_ARGS, async_openai_client, complete_ids, random_prompts, registered,
                                           served_model, start_secure_cluster, wait_for)  # fmt: skip


async def _streams(cluster: Cluster, prompts: list[list[int]], max_tokens: int, during) -> list[int]:
    client = async_openai_client(cluster)
    model = served_model(cluster)
    started = asyncio.Event()

    async def one(prompt: list[int]) -> int:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        tokens = 0  # a chunk may carry several tokens (decode merges what a slow reader left): count by usage
        async for chunk in stream:
            if chunk.choices:
                started.set()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    tasks = [asyncio.create_task(one(p)) for p in prompts]
    await asyncio.wait_for(started.wait(), timeout=60)
    await asyncio.to_thread(during)  # Redis goes away while the streams run
    try:
        return await asyncio.gather(*tasks)
    finally:
        await client.close()


def test_redis_outage_and_restart(tiny_model, dev_certs, tmp_path) -> None:
    with start_secure_cluster(tiny_model, dev_certs, num_prefill=1, num_decode=1, http_port=0, grpc_port=0, redis_url=None,
                       extra_args=ENGINE_ARGS, run_dir=str(tmp_path)) as cluster:  # fmt: skip
        redis_server = cluster.redis_server
        assert redis_server is not None and redis_server.is_running
        prompts = random_prompts([30, 45, 60], seed=11)
        expected = [complete_ids(cluster, p, max_tokens=6) for p in prompts]

        counts = asyncio.run(_streams(cluster, prompts, max_tokens=60, during=redis_server.stop))
        assert counts == [60, 60, 60], "in-flight streams did not finish while Redis was down"

        # Still down: the gateway routes with its last known registry.
        time.sleep(2.0)
        assert [complete_ids(cluster, p, max_tokens=6) for p in prompts] == expected

        redis_server.start()  # same port, empty
        wait_for(lambda: registered(cluster).get("decode") == 1 and registered(cluster).get("prefill") == 1,
                 timeout_s=30.0, what="decode and prefill re-registered")  # fmt: skip
        assert [complete_ids(cluster, p, max_tokens=6) for p in prompts] == expected
        assert all(p.is_running for p in cluster.processes), [p.name for p in cluster.processes if not p.is_running]
