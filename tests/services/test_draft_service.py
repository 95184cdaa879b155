"""The draft service with a real decode worker over real gRPC (and a real Redis for discovery):
greedy parity with transformers across architectures, acceptance with draft = target, the draft
dying mid-run, a refused tokenizer, bad input, leases, and no leaked blocks on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading
import time
from pathlib import Path

import grpc
import pytest

from services.decode.server import serve as serve_decode
from services.decode.speculation import build_decode_engine
from services.draft.server import DraftHandle, serve as serve_draft
from services.runtime.registry import EXTRA_SPEC_ACCEPTANCE_RATE, Role
from services.runtime.settings import CommonSettings, DraftSettings, EngineSettings
from tandem.v1 import common_pb2, decode_pb2_grpc, draft_pb2, draft_pb2_grpc, kv_transfer_pb2_grpc
from tests.conftest import ARCHS
from tests.engine.engine_helpers import hf_greedy, random_prompts
from tests.services.decode_helpers import DecodeHarness, collect, decode_request, decode_settings, free_port

VOCAB = 1024
MAX_TOKENS = 10


def draft_settings(model: Path, *, num_kv_blocks: int = 64, redis_url: str | None = None,
                   cluster: str = "tandem") -> DraftSettings:  # fmt: skip
    return DraftSettings(
        common=CommonSettings(model=str(model), served_model_name="tiny-draft", host="127.0.0.1", grpc_port=free_port(),
                              redis_url=redis_url, cluster=cluster, heartbeat_interval=0.2),  # fmt: skip
        engine=EngineSettings(device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, torch_threads=1),
    )


def spec_settings(target: Path, *, timeout_ms: int = 5000, adaptive: bool = True, **kw):
    return dataclasses.replace(decode_settings(target, **kw), speculative_method="draft", num_speculative_tokens=4,
                               draft_timeout_ms=timeout_ms, speculative_adaptive=adaptive)  # fmt: skip


class SpecDecodeHarness(DecodeHarness):
    """DecodeHarness over a prebuilt engine (its proposer pinned to the test's draft worker)."""

    def __init__(self, settings, engine) -> None:
        self.aloop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.aloop.run_forever, name="decode-test-loop", daemon=True)
        self._thread.start()
        self.handle = self.run(lambda: serve_decode(settings, engine=engine))
        self.channel = self.run(self._open_channel)
        self.decode = decode_pb2_grpc.DecodeStub(self.channel)
        self.kv = kv_transfer_pb2_grpc.KVTransferStub(self.channel)


class Pair:
    """A draft worker and a decode worker speculating with it, on one harness loop."""

    def __init__(self, target: Path, draft: Path, *, lease_s: float = 60.0, via_registry: tuple[str, str] | None = None,
                 timeout_ms: int = 5000, adaptive: bool = True) -> None:  # fmt: skip
        redis_url, cluster = via_registry or (None, "tandem")
        self.draft_settings = draft_settings(draft, redis_url=redis_url, cluster=cluster)
        self.harness: DecodeHarness | None = None
        self._pending_settings = spec_settings(target, redis_url=redis_url, cluster=cluster, timeout_ms=timeout_ms,
                                              adaptive=adaptive)  # fmt: skip
        self._draft_address = None if via_registry else f"127.0.0.1:{self.draft_settings.common.grpc_port}"
        self.lease_s = lease_s

    def __enter__(self) -> Pair:
        # The draft first, on a loop thread of its own, so decode finds it at its first step.
        self.dloop = asyncio.new_event_loop()
        self._dthread = threading.Thread(target=self.dloop.run_forever, daemon=True)
        self._dthread.start()
        self.draft: DraftHandle = self.drun(lambda: serve_draft(self.draft_settings, lease_s=self.lease_s))
        engine = build_decode_engine(self._pending_settings, draft_address=self._draft_address)
        self.harness = SpecDecodeHarness(self._pending_settings, engine)
        return self

    def drun(self, coro_fn, timeout: float = 60.0):
        async def go():
            return await coro_fn()

        return asyncio.run_coroutine_threadsafe(go(), self.dloop).result(timeout)

    def stop_draft(self) -> None:
        self.drun(lambda: self.draft.stop())

    def draft_at_baseline(self, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            ok = self.drun(lambda: self.draft.loop.call(_draft_idle))
            if ok or time.monotonic() > deadline:
                return ok
            time.sleep(0.05)

    def generate(self, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, **kw) -> list[list[int]]:
        async def go():
            calls = [self.harness.decode.Generate(decode_request(f"r{i}", p, max_tokens, remote=False, **kw))
                     for i, p in enumerate(prompts)]  # fmt: skip
            return await asyncio.gather(*(collect(c) for c in calls))

        return [r.tokens[0] for r in self.harness.run(go)]

    def __exit__(self, *exc) -> None:
        self.harness.close()
        self.drun(lambda: self.draft.stop())
        self.dloop.call_soon_threadsafe(self.dloop.stop)
        self._dthread.join(5)


def _draft_idle(worker) -> bool:
    worker.check_integrity()
    return worker.num_sequences == 0 and worker.kv.num_free_blocks == worker.kv.num_blocks


PROMPTS = random_prompts([4, 17, 40], VOCAB, seed=4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_draft_service_equals_transformers(model_factory, arch):
    target, draft = model_factory(arch, 0), model_factory(arch, 1)
    with Pair(target, draft) as pair:
        got = pair.generate(PROMPTS)
        stats = pair.harness.handle.engine.spec_stats
        assert stats.num_draft_tokens > 0  # the draft was really used
        assert got == hf_greedy(target, PROMPTS, MAX_TOKENS)
        # adaptive k has measured what a draft token costs here, and decode exports it
        cost = pair.harness.handle.metrics.registry.get_sample_value("tandem_spec_decode_draft_token_cost")
        assert 0 < cost <= 8.0, cost
        assert pair.harness.baseline_reached()
        assert pair.draft_at_baseline()  # decode released every finished sequence


def test_draft_equals_target_acceptance_metrics_status(tiny_model, redis_url, cluster, registry):
    """Found through the registry; acceptance >= 0.95; metrics and the heartbeat extra show it."""
    # k pinned: draft = target is priced as a loss by adaptive k (PINNED_K in cluster_helpers)
    with Pair(tiny_model, tiny_model, via_registry=(redis_url, cluster), adaptive=False) as pair:
        assert [w.role for w in registry.list_workers(Role.DRAFT)] == [Role.DRAFT]
        # Decode's registry view refreshes every second: wait until it has seen the draft worker.
        proposer = pair.harness.handle.engine.proposer
        deadline = time.monotonic() + 10
        while not proposer.discover() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = pair.generate(PROMPTS, max_tokens=24)
        assert got == hf_greedy(tiny_model, PROMPTS, 24)
        stats = pair.harness.handle.engine.spec_stats
        assert stats.acceptance_rate >= 0.95, stats
        m = pair.harness.handle.metrics.registry
        drafted = m.get_sample_value("tandem_spec_decode_draft_tokens_total")
        accepted = m.get_sample_value("tandem_spec_decode_accepted_tokens_total")
        assert drafted == stats.num_draft_tokens and accepted / drafted >= 0.95
        assert m.get_sample_value("tandem_spec_decode_accepted_tokens_per_position_total", {"position": "0"}) > 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            extra = registry.list_workers(Role.DECODE)[0].extra
            if EXTRA_SPEC_ACCEPTANCE_RATE in extra:
                break
            time.sleep(0.1)
        assert extra[EXTRA_SPEC_ACCEPTANCE_RATE] >= 0.95
        assert pair.harness.baseline_reached() and pair.draft_at_baseline()


def test_draft_dies_mid_run_output_unchanged(model_factory, tiny_model):
    draft = tiny_model  # draft = target, k pinned: every step speculates, so the cut lands mid-speculation
    prompts = random_prompts([9, 30], VOCAB, seed=8)
    with Pair(tiny_model, draft, timeout_ms=300, adaptive=False) as pair:
        h = pair.harness

        async def go():
            calls = [h.decode.Generate(decode_request(f"d{i}", p, 40, remote=False)) for i, p in enumerate(prompts)]
            tokens: list[list[int]] = [[], []]

            async def read_some(i: int, call, until: int | None) -> None:
                while until is None or len(tokens[i]) < until:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        return
                    for choice in msg.choices:
                        tokens[i].extend(choice.token_ids)

            await asyncio.gather(*(read_some(i, c, 6) for i, c in enumerate(calls)))  # both mid-run
            await asyncio.to_thread(pair.stop_draft)
            await asyncio.gather(*(read_some(i, c, None) for i, c in enumerate(calls)))
            return tokens

        got = h.run(go)
        assert got == hf_greedy(tiny_model, prompts, 40)
        assert h.handle.engine.proposer.num_failures >= 1  # the dead draft was noticed, not waited on forever
        assert h.baseline_reached()


def test_abort_mid_run_frees_both_sides(tiny_model):
    with Pair(tiny_model, tiny_model, adaptive=False) as pair:  # k pinned: the draft holds the request too
        h = pair.harness

        async def go():
            call = h.decode.Generate(decode_request("ab", PROMPTS[2], 200, remote=False))
            for _ in range(3):
                await call.read()
            call.cancel()

        h.run(go)
        assert h.baseline_reached()
        assert pair.draft_at_baseline()


def test_mismatched_tokenizer_is_refused(tiny_model, tmp_path, caplog):
    other = Path(shutil.copytree(tiny_model, tmp_path / "other-tokenizer"))
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + "\n")  # another hash
    with Pair(tiny_model, other) as pair:
        with caplog.at_level("ERROR"):
            got = pair.generate(PROMPTS[:2])
        assert got == hf_greedy(tiny_model, PROMPTS[:2], MAX_TOKENS)
        assert pair.harness.handle.engine.spec_stats.num_draft_tokens == 0
        assert any("tokenizer" in r.getMessage() and "refusing" in r.getMessage() for r in caplog.records)


def test_bad_input_lease_and_release(tiny_model):
    with Pair(tiny_model, tiny_model, lease_s=0.4) as pair:

        async def go():
            async with grpc.aio.insecure_channel(pair.draft.address) as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                info = await stub.GetInfo(draft_pb2.DraftInfoRequest())
                errors = []
                for seq in (dict(request_id="", token_ids=[5], reset=True, num_context_tokens=1),
                            dict(request_id="a", token_ids=[5], reset=True, num_context_tokens=1, num_draft_tokens=99),
                            dict(request_id="a", token_ids=[VOCAB + 3], reset=True, num_context_tokens=1)):  # fmt: skip
                    try:
                        [m async for m in stub.Propose(draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(**seq)]))]
                    except grpc.aio.AioRpcError as e:
                        errors.append((e.code(), e.details()))
                ok = [m async for m in stub.Propose(draft_pb2.ProposeRequest(sequences=[
                    draft_pb2.DraftSequence(request_id="x", reset=True, token_ids=[8, 9, 10], num_context_tokens=3,
                                            num_draft_tokens=3, sampling=draft_pb2.DraftSampling(temperature=0.7))]))]  # fmt: skip
                load = await stub.GetLoad(common_pb2.GetLoadRequest())
                released = await stub.Release(draft_pb2.ReleaseRequest(request_ids=["x", "unknown"]))
                return info, errors, ok, load, released

        info, errors, ok, load, released = pair.drun(go)
        assert info.vocab_size == VOCAB and info.max_num_draft_tokens >= 4 and len(info.tokenizer_hash) == 64
        assert [c for c, _ in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
        assert "request_id" in errors[0][1] and "num_draft_tokens" in errors[1][1] and "token_ids" in errors[2][1]
        assert ok[0].status == draft_pb2.PROPOSAL_STATUS_OK and len(ok[0].draft_token_ids) == 3
        assert ok[0].probs.num_rows == 3 and len(ok[0].probs.data) == 3 * VOCAB * 2  # float16 rows
        assert load.num_sequences == 1 and released.num_released == 1
        assert pair.draft_at_baseline()

        # A sequence nobody releases (a dead decode) is freed by the lease.
        async def orphan():
            async with grpc.aio.insecure_channel(pair.draft.address) as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                return [m async for m in stub.Propose(draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(
                    request_id="orphan", reset=True, token_ids=[8, 9], num_context_tokens=2, num_draft_tokens=2)]))]  # fmt: skip

        assert pair.drun(orphan)[0].status == draft_pb2.PROPOSAL_STATUS_OK
        assert pair.draft.worker.num_sequences == 1
        assert pair.draft_at_baseline(timeout=3.0)
