"""docs/deployment.md is current: the settings tables are generated, every documented metric is
charted by the Grafana dashboard and the dashboard charts only documented metrics."""

from __future__ import annotations

import json
import re

from services.runtime import settings as S

from tests.deploy.deploy_files import K8S, REPO_ROOT

DOC = REPO_ROOT / "docs" / "deployment.md"
BEGIN, END = "<!-- settings-table:begin -->\n", "<!-- settings-table:end -->"
CONTRACT_METRICS = {
    "tandem_requests_total", "tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
    "tandem_e2e_request_latency_seconds", "tandem_num_requests_running", "tandem_num_requests_waiting",
    "tandem_kv_blocks_used", "tandem_kv_blocks_total", "tandem_prefix_cache_hits_total",
    "tandem_prefix_cache_queries_total", "tandem_preemptions_total", "tandem_prefill_tokens_total",
    "tandem_kv_transfer_bytes_total", "tandem_kv_transfer_seconds", "tandem_kv_transfer_failures_total",
    "tandem_spec_decode_draft_tokens_total", "tandem_spec_decode_accepted_tokens_total",
    "tandem_spec_decode_draft_token_cost", "tandem_request_migrations_total", "tandem_decode_stalls_total",
    "tandem_kv_cache_usage_perc", "tandem_gc_pause_seconds",
}


def test_settings_tables_are_up_to_date():
    text = DOC.read_text()
    embedded = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    assert embedded == S.settings_markdown(), (
        "docs/deployment.md is stale: regenerate the block between the settings-table markers with "
        "`python -m services.runtime.settings --markdown`")


def documented_metrics() -> dict[str, str]:
    """name -> type, from the metrics table."""
    rows = re.findall(r"^\| `(tandem_[a-z0-9_]+)` \| (counter|gauge|histogram) \|", DOC.read_text(), re.M)
    return dict(rows)


def test_metrics_table_is_the_contract():
    metrics = documented_metrics()
    assert set(metrics) == CONTRACT_METRICS
    for name, kind in metrics.items():
        if kind == "counter":   # (tandem_kv_blocks_total is a gauge: total blocks, by contract)
            assert name.endswith("_total"), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name


def test_dashboard_charts_exactly_the_documented_metrics():
    dashboard = json.loads((K8S / "grafana" / "tandem-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = set()
    for expr in exprs:
        for name in re.findall(r"\btandem_[a-z0-9_]+", expr):
            used.add(re.sub(r"_(bucket|sum|count)$", "", name) if name.endswith(("_bucket", "_sum", "_count"))
                     and not name.endswith("_total") else name)
    metrics = documented_metrics()
    assert used == set(metrics)
    for expr in exprs:   # histograms are read through their buckets
        for name in re.findall(r"\b(tandem_[a-z0-9_]+)_bucket\b", expr):
            assert metrics[name] == "histogram"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]


def test_readme_requests_name_the_model_make_up_serves():
    # `make up` serves the Makefile's MODEL_DIR under its folder's name (settings: served_model_name's
    # default); a README example naming anything else gets a 404 from the first command a user copies.
    makefile = (REPO_ROOT / "Makefile").read_text()
    model = re.search(r"^MODEL \?= (\S+)$", makefile, re.M).group(1)
    assert re.search(r"^MODEL_DIR \?= models/\$\(MODEL\)$", makefile, re.M)
    named = re.findall(r'"model": "([^"]*)"', (REPO_ROOT / "README.md").read_text())
    assert named and set(named) == {model}
