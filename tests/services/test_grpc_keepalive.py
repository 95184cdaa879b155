"""A caller whose host vanishes (power, partition: no connection reset, so no cancellation reaches
the server) is found by the servers' keepalive pings (--grpc-keepalive): decode cancels its calls
and frees what they held at once, rather than at their 600 s lease.

The vanished host is a real gateway process frozen with SIGSTOP right after decode answered its
ReserveAndHold (the gateway's after_reserve hook parks it there): its TCP connection stays up
(the kernel still acknowledges), but its gRPC core answers no ping. Decode pings every 1 s and
gives up after 2 s; the test only polls (generously) for the pool to come back, so a loaded
machine changes when, never whether.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from services.runtime.grpc_server import keepalive_options
from tests.services.gateway_helpers import MiniCluster
from tests.services.test_gateway_sigkill_kv import LONG_LEASE_S, POLL_S, _expired, parked_after_reserve

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]


@pytest.fixture(scope="module")
def pinging(tiny_model, redis_url) -> Iterator[MiniCluster]:
    cluster = MiniCluster(tiny_model, redis_url, worker_common={"grpc_keepalive": 1.0, "grpc_keepalive_timeout": 2.0})
    cluster.decode.table.default_lease_s = LONG_LEASE_S
    cluster.redis_url = redis_url  # for the gateway process
    yield cluster
    cluster.close()


def test_keepalive_options():
    assert keepalive_options(0, 20) == []
    assert dict(keepalive_options(30, 20)) == {"grpc.keepalive_time_ms": 30000, "grpc.keepalive_timeout_ms": 20000,
                                               "grpc.http2.ping_timeout_ms": 20000,
                                               "grpc.http2.max_pings_without_data": 0}


def test_a_frozen_caller_loses_its_reservation_to_keepalive(pinging):
    with parked_after_reserve(pinging, 44) as (gateway, expired):
        gateway.proc.send_signal(signal.SIGSTOP)  # vanished: no FIN, no RST, no ping answers
        assert pinging.decode_at_baseline(timeout=POLL_S), "decode kept the frozen caller's reservation"
        assert _expired(pinging) == expired, "freed by the lease, not by keepalive"
        assert gateway.proc.poll() is None  # still there (stopped): nothing closed its connection
