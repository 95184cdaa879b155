"""`tandem up` itself heals: SIGKILL of its decode worker is reported, the worker is restarted
on its port, the gateway serves again, `tandem status` shows the restart; SIGKILL of the gateway
is taken over by its warm standby (on by default), which then serves; Ctrl-C still exits 0.
Plaintext on purpose: `tandem up`'s default (the secure fault cluster heals over mTLS)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx

from tests.cluster.cluster_helpers import ENGINE_ARGS, wait_for
from tests.cluster.test_cluster_launcher import _read_until, _tandem_up


def _healthy(http: str) -> bool:
    try:
        return httpx.get(http + "/health", timeout=10).status_code == 200
    except httpx.ConnectError:  # a port nobody listens on yet: the gateway is between processes
        return False


def test_tandem_up_restarts_a_killed_decode_worker(tiny_model, tmp_path) -> None:
    proc, lines = _tandem_up("--model", str(tiny_model), "--mode", "aggregated", "--port", "0", "--grpc-port", "0",
                             "--cluster", "up-heal", "--restart-backoff", "0.2", "--startup-timeout", "600",
                             *ENGINE_ARGS, run_dir=tmp_path)  # fmt: skip
    try:
        banner = _read_until(lines, "Press Ctrl-C", timeout_s=600)
        http = re.search(r"OpenAI REST\s+(http://\S+)/v1", banner).group(1)
        status_cmd = re.search(r"status\s+(tandem status .*)", banner).group(1).split()
        decode_pid = int(re.search(r"decode-0\s+pid (\d+)", banner).group(1))
        gateway_pid = int(re.search(r"gateway-0\s+pid (\d+)", banner).group(1))
        standby_pid = int(re.search(r"gateway-0-standby\s+pid (\d+)\s+warm", banner).group(1))
        ready = f"standby for gateway-0 ready (pid {standby_pid}"
        if ready not in banner:
            _read_until(lines, ready, timeout_s=600)
        os.kill(decode_pid, signal.SIGKILL)
        healed = _read_until(lines, "restarted decode-0", timeout_s=600)
        assert "decode-0 exited with code -9; restarting it in" in healed
        wait_for(lambda: httpx.get(http + "/health", timeout=10).status_code == 200, timeout_s=600,
                 what="gateway healthy again")  # fmt: skip

        def status() -> str:
            return subprocess.run([sys.executable, "-m", "services.cli", *status_cmd[1:]],
                                  capture_output=True, text=True, timeout=60).stdout  # fmt: skip

        wait_for(lambda: "decode-0 restarted 1x (exit codes -9)" in status(), timeout_s=120, what="status line")
        os.kill(gateway_pid, signal.SIGKILL)
        took_over = _read_until(lines, "standby promoted", timeout_s=600)
        assert "gateway-0 exited with code -9; its standby takes over now" in took_over
        assert f"gateway-0 is now pid {standby_pid} (the standby was ready" in took_over
        wait_for(lambda: _healthy(http), timeout_s=600, what="the promoted standby serving")
        wait_for(lambda: "gateway-0 restarted 1x (exit codes -9), 1x by its standby" in status(), timeout_s=120,
                 what="status line with the takeover")  # fmt: skip
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
