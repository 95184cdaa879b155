"""Issue 5, acceptance 2: /metrics of every service of a real cluster parses as Prometheus text,
shows exactly the metrics docs/deployment.md's table says it serves, and its counters move as
expected when one request goes through (prefill tokens and KV bytes sent; decode KV bytes received,
spec decode counters; gateway outcome count, TTFT / ITL / e2e histograms; KV gauges)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import get, post, random_prompts, wait_for

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
PROMPT = random_prompts((70,), seed=23)[0]
MAX_TOKENS = 12


def served_by_doc() -> dict[str, set[str]]:
    """role -> metric family names, from the table's "served by" column ("all" = every role)."""
    rows = re.findall(r"^\| `(tandem_[a-z0-9_]+)` \| (?:counter|gauge|histogram) \|[^|]*\|[^|]*\| ([^|]+) \|",
                      DOC.read_text(), re.M)  # fmt: skip
    roles: dict[str, set[str]] = {r: set() for r in ("gateway", "prefill", "decode", "draft")}
    for name, who in rows:
        for role in roles if who.strip() == "all" else [w.strip() for w in who.split(",")]:
            roles[role].add(name)
    return roles


def scrape(read: Callable[[], str]) -> tuple[set[str], dict[str, float]]:
    """(family names as exposed, e.g. tandem_requests_total; samples {'name{l="v"}': value})."""
    text = read()
    families, samples = set(), {}
    for family in text_string_to_metric_families(text):  # raises on anything that is not Prometheus text
        families.add(family.name + ("_total" if family.type == "counter" else ""))
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return families, samples


def endpoints(cluster: Cluster) -> dict[str, Callable[[], str]]:
    """role -> a reader of its /metrics: the workers' plain-HTTP metrics ports, the gateway's public
    port (HTTPS in a secure cluster)."""
    readers: dict[str, Callable[[], str]] = {
        p.role: lambda url=str(p.metrics_url): httpx.get(url, timeout=10.0).text
        for p in cluster.processes if p.role != "gateway"}  # fmt: skip
    return {**readers, "gateway": lambda: get(cluster, "/metrics", timeout=10.0).text}


def test_metrics_parse_match_the_doc_and_move(traced: Cluster) -> None:
    readers = endpoints(traced)
    doc = served_by_doc()
    before = {}
    for role, read in readers.items():
        families, before[role] = scrape(read)
        exposed = {f for f in families if f.startswith("tandem_") and not f.endswith("_created")}  # client's *_created
        assert exposed - {
            "tandem_spec_decode_accepted_tokens_per_position_total"} == doc[role], role
        # every service process counts its collections from start-up, the full one before its freeze included
        assert before[role]['tandem_gc_pause_seconds_count{generation="2"}'] >= 1, role

    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    reply = post(traced, "/v1/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text

    def delta(role: str, key: str) -> float:
        return scrape(readers[role])[1].get(key, 0.0) - before[role].get(key, 0.0)

    # gateway: the outcome count and one TTFT / e2e observation, ITL per later token
    assert delta("gateway", 'tandem_requests_total{outcome="success"}') == 1
    assert delta("gateway", "tandem_time_to_first_token_seconds_count") == 1
    assert delta("gateway", "tandem_e2e_request_latency_seconds_count") == 1
    assert delta("gateway", "tandem_inter_token_latency_seconds_count") >= 1
    # prefill computed the prompt (nothing cached: a fresh random prompt) and shipped its KV
    assert delta("prefill", "tandem_prefill_tokens_total") == len(PROMPT)
    assert delta("prefill", "tandem_prefix_cache_queries_total") >= len(PROMPT) - 16
    sent = delta("prefill", 'tandem_kv_transfer_bytes_total{direction="send"}')
    assert sent > 0
    assert delta("prefill", 'tandem_kv_transfer_seconds_count{direction="send"}') >= 1
    # decode received the same bytes and speculated with the draft
    assert delta("decode", 'tandem_kv_transfer_bytes_total{direction="recv"}') == sent
    assert delta("decode", 'tandem_kv_transfer_seconds_count{direction="recv"}') == 1
    assert delta("decode", "tandem_prefill_tokens_total") == 0  # disaggregated: prefill computed it
    assert delta("decode", "tandem_spec_decode_draft_tokens_total") > 0
    assert delta("decode", "tandem_spec_decode_accepted_tokens_total") > 0
    # KV gauges: sized pools on every engine service (the draft's after it served a Propose)
    for role in ("prefill", "decode", "draft"):
        assert scrape(readers[role])[1]["tandem_kv_blocks_total"] > 0, role
    # nothing failed, and decode's pool drains back (prefix-cache blocks may stay "used")
    for role in ("prefill", "decode"):
        assert not any(k.startswith("tandem_kv_transfer_failures_total") and v for k, v in scrape(readers[role])[1].items())
    wait_for(lambda: scrape(readers["decode"])[1]["tandem_num_requests_running"] == 0, timeout_s=10,
             what="decode idle")  # fmt: skip
