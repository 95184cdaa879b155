"""Smoke test of benchmarks/serve_vs_peers.py's Tandem path: `tandem up` on the tiny random model,
one stream for ~3 s from the builtin client, one JSON row. It checks the figures are there and
sane, never how fast they are (the full comparison with the peers runs outside `make test`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def test_tandem_path_writes_a_sane_row(tiny_model, tmp_path):
    out = tmp_path / "serve_vs_peers.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_vs_peers.py"), "--models", str(tiny_model),
           "--servers", "tandem", "--streams", "1", "--duration", "3", "--client", "builtin", "--no-limits",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert "error" not in row, row
    assert (row["server"], row["streams"], row["client"]) == ("tandem", 1, "builtin")
    assert row["requests"] >= 1
    assert row["output_tok_s"] > 0
    assert 0 < row["ttft_p50_ms"] < 60_000
    assert row["ttft_p90_ms"] >= row["ttft_p50_ms"] and row["ttft_mean_ms"] > 0
    assert "TTFT p90 / mean ms:" in result["table"]
    assert 0 < row["itl_p50_ms"] < 60_000 and not math.isnan(row["itl_p50_ms"])
    assert "| Tandem |" in result["table"] and "machine" in result


def _row(server: str, k: int, tok_s: float, ttft: float, itl: float = 1.0) -> dict:
    return {"model": "m", "server": server, "title": server, "streams": 1, "round": k, "output_tok_s": tok_s,
            "ttft_p50_ms": ttft, "itl_p50_ms": itl, "ttft_p90_ms": ttft * 2, "ttft_mean_ms": ttft, "requests": 10}


def test_rounds_give_each_figures_median_and_each_rounds_ratio():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_vs_peers

    # The machine drifts between rounds (both servers alike): round 2 is slow for everyone.
    rounds = [_row("tandem", 0, 110, 9), _row("llama", 0, 100, 10),
              _row("llama", 1, 60, 20), _row("tandem", 1, 63, 19),
              _row("tandem", 2, 108, 8), _row("llama", 2, 100, 9)]
    rounds.append({"model": "m", "server": "vllm", "title": "vllm", "streams": 1, "round": 0, "error": "boom"})
    rows = {r["server"]: r for r in serve_vs_peers.median_rows(rounds)}
    assert rows["tandem"]["output_tok_s"] == 108 and rows["llama"]["ttft_p50_ms"] == 10
    assert rows["tandem"]["requests"] == 30 and rows["tandem"]["rounds"] == 3 and "round" not in rows["tandem"]
    assert rows["vllm"]["error"] == "boom"
    per = serve_vs_peers.round_ratios(rounds, "m", [1], 3)["1"]
    assert [round(r["tok_s"], 2) for r in per["rounds"]] == [1.1, 1.05, 1.08]
    assert per["tok_s"] == pytest.approx(1.08) and per["ttft"] == pytest.approx(0.9)


def test_bandwidth_share_uses_the_copy_measured_around_tandems_level():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_vs_peers

    model = serve_vs_peers.Model("m", Path("m"), "m", params=1_000_000_000 // 4)  # 1 GB of float32 a token
    # Round 0 ran while the copy did 30-34 GB/s (bound 32 tok/s), round 1 at 50 (bound 50 tok/s).
    rounds = [{**_row("tandem", 0, 24, 9), "copy_gb_s_around": [30.0, 34.0]},
              {**_row("tandem", 1, 40, 9), "copy_gb_s_around": [50.0, 50.0]},
              _row("llama", 0, 20, 10)]
    assert serve_vs_peers.bandwidth_share_around(rounds, model, 4) == pytest.approx((0.75 + 0.8) / 2)
    assert serve_vs_peers.bandwidth_share_around([_row("tandem", 0, 24, 9)], model, 4) is None  # not measured
    assert "copy_gb_s_around" not in serve_vs_peers.median_rows(rounds)[0]  # one round's reading is no median


def test_a_retried_guidellm_level_draws_prompts_no_level_sent():
    # A level whose guidellm run hung is run again; the killed run had sent its seed's prompts, so a
    # retry on the same seed met them in the server's prompt cache (a 21.6 ms "cold" TTFT).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_vs_peers
    from stream_load import retry_seed

    levels = (1, 2, 4, 8, 16, 32, 64)
    seeds = {serve_vs_peers.level_seed(42, s) for s in levels}
    for s in levels:
        first = serve_vs_peers.level_seed(42, s)
        assert retry_seed(first, 1) == first
        assert retry_seed(first, 2) not in seeds


# A stand-in for guidellm's command line (not installed by `make test`): records each run's seed,
# never returns on the first run (as guidellm 0.8.1 now and then does), writes a report on the next.
_FAKE_GUIDELLM = """#!{python}
import json, sys, time
args = dict(zip(sys.argv[3::2], sys.argv[4::2]))
with open({seeds!r}, "a") as f:
    f.write(str(json.loads(args["--seed"])["value"]) + "\\n")
if len(open({seeds!r}).read().split()) == 1:
    time.sleep(600)
stat = {{"mean": 100.0, "median": 5.0, "percentiles": {{"p90": 9.0}}}}
report = {{"benchmarks": [{{"config": {{"strategy": {{"streams": 4}}}}, "metrics": {{
    "request_totals": {{"successful": 10, "errored": 0}},
    "output_tokens_per_second": {{"total": stat}}, "time_to_first_token_ms": {{"successful": stat}},
    "inter_token_latency_ms": {{"successful": stat}}}}}}]}}
json.dump(report, open(json.loads(args["--output"])["path"], "w"))
"""


def test_a_hung_guidellm_level_is_killed_and_run_again_on_fresh_prompts(tmp_path, monkeypatch):
    import http.server
    import threading

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import stream_load

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    seeds = tmp_path / "seeds"
    guidellm = tmp_path / "guidellm"
    guidellm.write_text(_FAKE_GUIDELLM.format(python=sys.executable, seeds=str(seeds)))
    guidellm.chmod(0o755)
    monkeypatch.setattr(stream_load, "HANG_GRACE_S", 3.0)
    try:
        level = stream_load.run_guidellm(guidellm, f"http://127.0.0.1:{server.server_port}", tmp_path, 4, 0.1,
                                         128, 64, tmp_path / "out", seed=4042)
    finally:
        server.shutdown()
    assert seeds.read_text().split() == ["4042", str(stream_load.retry_seed(4042, 2))]
    assert (level.attempt, level.seed, level.streams, level.requests) == (2, stream_load.retry_seed(4042, 2), 4, 10)
    assert level.to_dict()["seed"] == level.seed


def test_the_table_names_a_level_that_was_retried():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_vs_peers

    model = serve_vs_peers.Model("m", Path("m"), "m", params=1_000_000)
    rows = [_row("tandem", 0, 110, 9), {**_row("llama", 0, 100, 10), "attempt": 2, "seed": 1542}]
    extra = {"client": "guidellm", "prompt_tokens": 128, "output_tokens": 64, "duration_s": 30,
             "ratios": {}, "bounds": {}}
    text = serve_vs_peers.table(rows, [model], ["tandem", "llama"], [1], extra)
    assert "retried after guidellm hung (m / llama at 1)" in text
    assert "retried" not in serve_vs_peers.table(rows[:1], [model], ["tandem"], [1], extra)
