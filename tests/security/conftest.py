"""Fixtures of the security tests: a second `tandem certs` folder (another CA; the session's own,
`dev_certs`, is in tests/conftest.py), and one in-process stack of real services (draft, decode,
prefill, gateway) with mTLS everywhere and API keys on the gateway."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from services.runtime import certs
from services.runtime.settings import (CommonSettings, DecodeSettings, DraftSettings, EngineSettings,
                                       GatewaySettings, PrefillSettings)  # fmt: skip
from services.runtime.tls import TlsIdentity
from tests.cluster.cluster_helpers import wait_for
from tests.services.gateway_helpers import MODEL_NAME, free_port, served_model

T = TypeVar("T")
API_KEYS = ("sk-tandem-Alpha-1", "sk-tandem-Beta-2")


@pytest.fixture(scope="session")
def other_certs(tmp_path_factory) -> Path:
    """Certificates of another CA (same names, same SANs): what a wrong-CA client holds."""
    return certs.write_certs(tmp_path_factory.mktemp("other-certs"), ca_name="Some other CA")


def identity(directory: Path, name: str) -> TlsIdentity:
    files = certs.files(directory, name)
    return TlsIdentity.load(files.cert, files.key, files.ca)


def tls_common(directory: Path, role: str, **kw: Any) -> CommonSettings:
    files = certs.files(directory, role)
    # The workers share one loop thread with the gateway (TLS handshakes, a loop of bad-key
    # requests): a 1 s interval (TTL 3 s) keeps their records alive through that on a loaded machine.
    return CommonSettings(model=kw.pop("model"), served_model_name=MODEL_NAME, host="127.0.0.1",
                          heartbeat_interval=1.0, log_level="warning", tls_cert=str(files.cert),
                          tls_key=str(files.key), tls_ca=str(files.ca), **kw)  # fmt: skip


def engine_settings() -> EngineSettings:
    return EngineSettings(device="cpu", dtype="float32", block_size=16, num_kv_blocks=96,
                          max_num_batched_tokens=64, max_num_seqs=16, torch_threads=1)  # fmt: skip


class LoopThread:
    """An event loop on its own thread: services are served there, tests call in with run()."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], Awaitable[T]], timeout: float = 180.0) -> T:
        async def go() -> T:
            return await fn()

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class SecureStack:
    """draft <- decode <- prefill <- gateway, all mTLS, on one event-loop thread."""

    draft: Any
    decode: Any
    prefill: Any
    gateway: Any

    @property
    def workers(self) -> dict[str, str]:
        """role -> the gRPC address of each service (the gateway's public gRPC port included)."""
        return {"draft": self.draft.address, "decode": self.decode.address, "prefill": self.prefill.address,
                "gateway": f"127.0.0.1:{self.gateway.grpc_port}"}  # fmt: skip

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.gateway.http_port}"


def _wait_until_routable(handle: Any) -> None:
    """Until the gateway's registry view holds the decode and the prefill worker: their first
    heartbeats are written from the shared loop while the next service starts, so a test that
    begins at once could be routed before the gateway has seen them (503 no_decode_worker)."""
    gateway = handle.gateway
    wait_for(lambda: gateway.orchestrator.decode_workers() and gateway.view.workers("prefill"), timeout_s=120,
             interval_s=0.05, what="the gateway seeing a decode and a prefill worker")  # fmt: skip


@pytest.fixture(scope="package")
def secure_stack(tiny_model, redis_url, dev_certs) -> Iterator[SecureStack]:
    from services.decode.server import serve as serve_decode
    from services.draft.server import serve as serve_draft
    from services.gateway.main import serve as serve_gateway
    from services.prefill.main import serve as serve_prefill

    cluster = f"sec-{uuid.uuid4().hex[:8]}"
    thread = LoopThread("security-test-loop")
    run = thread.run
    model = str(tiny_model)
    draft = run(lambda: serve_draft(DraftSettings(
        common=tls_common(dev_certs, "draft", model=model, grpc_port=free_port()), engine=engine_settings())))
    # A draft timeout far beyond any step: every step's proposal arrives, so draft tokens are counted.
    decode = run(lambda: serve_decode(DecodeSettings(
        common=tls_common(dev_certs, "decode", model=model, grpc_port=free_port(), redis_url=redis_url,
                          cluster=cluster),
        engine=engine_settings(), speculative_method="draft", num_speculative_tokens=2,
        speculative_adaptive=False, draft_timeout_ms=600_000, draft_address=draft.address)))  # fmt: skip
    prefill = run(lambda: serve_prefill(PrefillSettings(
        common=tls_common(dev_certs, "prefill", model=model, redis_url=redis_url, cluster=cluster),
        engine=engine_settings()), grpc_port=0))  # fmt: skip
    gateway = run(lambda: serve_gateway(GatewaySettings(
        common=tls_common(dev_certs, "gateway", model=model, redis_url=redis_url, cluster=cluster),
        mode="disaggregated", prefill_chunk_size=16, api_keys=API_KEYS, public_tls="mtls"),
        http_port=0, grpc_port=0, model=served_model(tiny_model)))  # fmt: skip
    _wait_until_routable(gateway)
    try:
        yield SecureStack(draft, decode, prefill, gateway)
    finally:
        for handle in (gateway, prefill, decode, draft):
            run(handle.stop)
        thread.close()
