"""Routing records in Redis: a routed request has `{cluster}:route:{id}` (with a TTL) while it runs,
and a second gateway replica can abort a request that the first one holds, through that record."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import redis

from services.launcher.cluster import Cluster
from services.runtime import certs
from services.runtime.health_probe import check_grpc
from services.runtime.redis_server import find_free_port
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.cluster.cluster_helpers import gateway_channel, kv_usage, wait_for


def _stream(cluster: Cluster, request_id: str, out: list) -> None:
    with gateway_channel(cluster) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        req = generation_pb2.GenerateRequest(
            request_id=request_id, token_ids=generation_pb2.TokenIds(ids=list(range(10, 60))),
            sampling=common_pb2.SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
        )  # fmt: skip
        try:
            for response in stub.Generate(req, timeout=120):
                out.append(response)
        except grpc.RpcError as e:
            out.append(e)


def test_second_gateway_aborts_through_route_record(disagg: Cluster, tiny_model, tmp_path) -> None:
    port, grpc_port = find_free_port("127.0.0.1"), find_free_port("127.0.0.1")
    log = open(tmp_path / "gateway-2.log", "w")
    # The second replica is configured like the first: mTLS to the workers, TLS and the key in front.
    tls = certs.files(str(disagg.spec.tls_dir), "gateway")
    second = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "gateway", "--model", str(tiny_model), "--host", "127.0.0.1",
         "--http-port", str(port), "--grpc-port", str(grpc_port), "--redis-url", disagg.redis_url,
         "--cluster", disagg.cluster, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TANDEM_API_KEYS": ",".join(disagg.spec.api_keys)},
    )  # fmt: skip
    try:
        address = f"127.0.0.1:{grpc_port}"
        assert wait_for(lambda: check_grpc(address, tls=disagg.gateway.probe_tls, role="gateway")[0], timeout_s=300,
                        what="the second gateway serving")  # fmt: skip
        out: list = []
        t = threading.Thread(target=_stream, args=(disagg, "route-test-1", out))
        t.start()
        client = redis.Redis.from_url(disagg.redis_url)
        key = f"{disagg.cluster}:route:route-test-1"
        assert wait_for(lambda: client.exists(key) and len(out) > 0, timeout_s=30)
        assert client.pttl(key) > 0
        with gateway_channel(disagg, address) as channel:
            reply = generation_pb2_grpc.GenerationStub(channel).Abort(
                common_pb2.AbortRequest(request_id="route-test-1", reason="test"), timeout=10)
        assert reply.aborted
        t.join(60)
        assert not t.is_alive()
        assert len([r for r in out if not isinstance(r, Exception)]) < 3000  # cut short
        assert wait_for(lambda: not client.exists(key) or client.pttl(key) > 0, timeout_s=10)
        assert wait_for(lambda: all(u.used == 0 and u.idle for u in kv_usage(disagg).values()), timeout_s=30)
    finally:
        second.terminate()
        second.wait(30)
        log.close()
