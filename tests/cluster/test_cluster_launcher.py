"""`tandem up` itself: flag routing and validation (no processes), then the real command: it
starts a cluster (with --tls-dir and --api-key, as every test cluster), prints its endpoints and a
working `tandem status` hint, stops every process on SIGINT; and when a service dies during startup
it stops the rest and exits 1 with that log's tail (plaintext: `tandem up`'s default)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.launcher.cluster import ClusterSpec, LaunchError, route_extra_args
from services.runtime import certs
from services.runtime.tls import TlsIdentity
from tests.cluster.cluster_helpers import API_KEY, ENGINE_ARGS

ROLES = ("gateway", "prefill", "decode", "draft")


def test_flags_go_to_the_services_that_have_them() -> None:
    routed = route_extra_args(["--num-kv-blocks", "64", "--prefill-chunk-size=32", "--log-level", "debug",
                               "--no-enable-prefix-caching", "--kv-lease-seconds", "5"], ROLES)  # fmt: skip
    assert routed["gateway"] == ["--prefill-chunk-size=32", "--log-level", "debug"]
    assert routed["prefill"] == ["--num-kv-blocks", "64", "--log-level", "debug", "--no-enable-prefix-caching"]
    assert routed["decode"] == routed["prefill"] + ["--kv-lease-seconds", "5"]
    assert routed["draft"] == routed["prefill"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--grpc-port", "1"], "set by tandem up"), (["--metrics-port", "1"], "set by tandem up"),
     (["--bogus", "1"], "unknown flag --bogus"), (["--num-kv-blocks"], "needs a value"), (["stray"], "unexpected")],
)  # fmt: skip
def test_bad_pass_through_flags(args, message) -> None:
    with pytest.raises(LaunchError, match=message):
        route_extra_args(args, ROLES)


def test_spec_validation(tiny_model, tmp_path) -> None:
    assert ClusterSpec(model=str(tiny_model)).num_prefill == 1
    assert ClusterSpec(model=str(tiny_model), mode="aggregated").num_prefill == 0
    assert ClusterSpec(model=str(tiny_model), mode="aggregated").roles == ("gateway", "decode")
    with pytest.raises(LaunchError, match="aggregated mode runs no prefill"):
        ClusterSpec(model=str(tiny_model), mode="aggregated", num_prefill=2)
    with pytest.raises(LaunchError, match="no config.json"):
        ClusterSpec(model=str(tmp_path))
    with pytest.raises(LaunchError, match="--decode 0"):
        ClusterSpec(model=str(tiny_model), num_decode=0)


def _tandem_up(*args: str, run_dir: Path) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", *args, "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "REDIS_URL": ""},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    return proc, lines


def _read_until(lines: queue.Queue[str], marker: str, timeout_s: float) -> str:
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            seen.append(lines.get(timeout=0.5))
        except queue.Empty:
            continue
        if marker in seen[-1]:
            return "".join(seen)
    raise AssertionError(f"{marker!r} not printed within {timeout_s:.0f} s:\n{''.join(seen)}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (reaped later by whoever owns it).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_tandem_up_prints_endpoints_and_stops_on_sigint(tiny_model, dev_certs, tmp_path) -> None:
    proc, lines = _tandem_up("--model", str(tiny_model), "--mode", "aggregated", "--port", "0", "--grpc-port", "0",
                             "--cluster", "up-test", "--tls-dir", str(dev_certs), "--api-key", API_KEY, *ENGINE_ARGS,
                             run_dir=tmp_path)  # fmt: skip
    try:
        banner = _read_until(lines, "Press Ctrl-C", timeout_s=180)
        https = re.search(r"OpenAI REST\s+(https://\S+)/v1", banner).group(1)
        status_cmd = re.search(r"status\s+(tandem status .*)", banner).group(1).split()
        pids = [int(pid) for pid in re.findall(r"pid (\d+)", banner)]  # gateway, decode, the standby gateway
        assert len(pids) == 3 and (tmp_path / "decode-0.log").is_file() and (tmp_path / "gateway-0.log").is_file()
        assert re.search(r"gateway-0-standby\s+pid \d+\s+warm", banner), banner
        assert API_KEY not in banner and not any(API_KEY in p.read_text() for p in tmp_path.glob("*.log"))
        client = certs.files(dev_certs, certs.CLIENT)
        verify = TlsIdentity.load(client.cert, client.key, client.ca).client_ssl_context()
        assert httpx.get(https + "/health", verify=verify, timeout=10).status_code == 200
        assert httpx.get(https + "/v1/models", verify=verify, timeout=10).status_code == 401
        models = httpx.get(https + "/v1/models", verify=verify, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert models.status_code == 200, models.text

        shown = subprocess.run([sys.executable, "-m", "services.cli", *status_cmd[1:], "--json"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["workers_by_role"]["decode"] == 1

        proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # a double Ctrl-C: the second must not cut the first's handling short
        assert proc.wait(timeout=60) == 0
        for pid in pids:
            assert not _alive(pid), f"service pid {pid} still running after tandem up exited"
        time.sleep(0.5)  # the reader thread drains the pipe
        output = "".join(lines.queue)
        assert "Traceback" not in output and "stopping the cluster" in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_tandem_up_exits_1_with_log_tail_when_a_service_dies(tiny_model, tmp_path) -> None:
    # --max-num-seqs 0 passes tandem up (values are the services' to check) and kills decode at start.
    proc, lines = _tandem_up("--model", str(tiny_model), "--mode", "aggregated", "--port", "0", "--grpc-port", "0",
                             "--max-num-seqs", "0", run_dir=tmp_path)  # fmt: skip
    try:
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    output = "".join(lines.queue)
    assert "decode-0 exited with code" in output, output
    assert "max_num_seqs" in output or "--max-num-seqs" in output, output


def test_auto_threads_split_the_cores_between_engine_services(tiny_model, monkeypatch) -> None:
    from services.launcher import cluster
    from services.launcher.cluster import build_processes

    monkeypatch.setattr(cluster, "available_cores", lambda: 8)
    assert ClusterSpec(model=str(tiny_model), mode="aggregated", torch_threads="auto").threads_per_engine() == 8
    assert ClusterSpec(model=str(tiny_model), torch_threads="auto").threads_per_engine() == 4  # prefill + decode
    with_draft = ClusterSpec(model=str(tiny_model), mode="aggregated", draft_model=str(tiny_model), torch_threads="auto")
    # decode and its draft take turns on the box's cores: each gets all of them, and the draft
    # does not draft ahead (it would compete with the verification it waits on)
    assert (with_draft.threads_per_engine("decode"), with_draft.threads_per_engine("draft")) == (8, 8)
    procs = {p.role: p for p in build_processes(with_draft, "redis://127.0.0.1:1/0", Path("/tmp"))}
    assert "--spec-torch-threads" not in procs["decode"].argv
    assert procs["draft"].argv[procs["draft"].argv.index("--torch-threads") + 1] == "8"
    assert "--no-lookahead" in procs["draft"].argv
    monkeypatch.setattr(cluster, "available_cores", lambda: 2)
    assert ClusterSpec(model=str(tiny_model), num_decode=3, torch_threads="auto").threads_per_engine() == 1
    assert ClusterSpec(model=str(tiny_model), torch_threads=3).threads_per_engine() == 3
    with pytest.raises(LaunchError, match="--torch-threads"):
        ClusterSpec(model=str(tiny_model), torch_threads=0)


def test_tandem_up_defaults_to_aggregated_with_auto_threads(tiny_model) -> None:
    from services.launcher.cluster import build_processes
    from services.launcher.up import spec_from_args

    spec = spec_from_args(["--model", str(tiny_model)])
    assert (spec.mode, spec.torch_threads, spec.roles) == ("aggregated", "auto", ("gateway", "decode"))
    decode = next(p for p in build_processes(spec, "redis://127.0.0.1:1/0", Path("/tmp")) if p.role == "decode")
    threads = decode.argv[decode.argv.index("--torch-threads") + 1]
    assert int(threads) == spec.threads_per_engine() >= 1


def test_draft_weight_dtype_goes_to_the_draft_alone(tiny_model) -> None:
    from services.launcher.cluster import build_processes
    from services.launcher.up import spec_from_args

    spec = spec_from_args(["--model", str(tiny_model), "--draft-model", str(tiny_model),
                           "--draft-weight-dtype", "bfloat16"])  # fmt: skip
    argv = {p.role: p.argv for p in build_processes(spec, "redis://127.0.0.1:1/0", Path("/tmp"))}
    assert argv["draft"][argv["draft"].index("--weight-dtype") + 1] == "bfloat16"
    assert "--weight-dtype" not in argv["decode"]
    with pytest.raises(LaunchError, match="--draft-weight-dtype needs --draft-model"):
        spec_from_args(["--model", str(tiny_model), "--draft-weight-dtype", "bfloat16"])
