"""Prometheus metrics of every service: the names and meanings of docs/deployment.md.

Each service builds one `ServiceMetrics` with its own registry (so several services can live in
one test process without mixing counters) and serves it on /metrics. Engine gauges and counters
are refreshed from the engine after each step by `observe_engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from services.runtime import heap

# Which service exposes which metric: the "served by" column of docs/deployment.md's table (a test
# holds both to it). Every ServiceMetrics has every attribute, so shared code can update any of
# them, but only its role's are registered: a prefill worker must not show up in the gateway's
# `tandem_requests_total` panels, nor the gateway report empty KV gauges.
_ENGINE = ("tandem_num_requests_running", "tandem_num_requests_waiting", "tandem_kv_blocks_used",
           "tandem_kv_blocks_total", "tandem_kv_cache_usage_perc", "tandem_prefix_cache_hits", "tandem_prefix_cache_queries",
           "tandem_preemptions", "tandem_prefill_tokens", "tandem_kv_transfer_bytes", "tandem_kv_transfer_seconds",
           "tandem_kv_transfer_failures")  # fmt: skip
_EVERY_ROLE = ("tandem_gc_pause_seconds",)  # heap.py's collector: the process's own pauses
SERVED_BY: dict[str, frozenset[str]] = {
    "gateway": frozenset({*_EVERY_ROLE, "tandem_requests", "tandem_time_to_first_token_seconds", "tandem_inter_token_latency_seconds",
                          "tandem_e2e_request_latency_seconds", "tandem_num_requests_running",
                          "tandem_num_requests_waiting", "tandem_kv_cache_usage_perc", "tandem_request_migrations",
                          "tandem_decode_stalls"}),
    "prefill": frozenset({*_EVERY_ROLE, *_ENGINE}),
    "decode": frozenset({*_EVERY_ROLE, *_ENGINE, "tandem_spec_decode_draft_tokens", "tandem_spec_decode_accepted_tokens",
                         "tandem_spec_decode_accepted_tokens_per_position", "tandem_spec_decode_draft_token_cost"}),
    "draft": frozenset({*_EVERY_ROLE, "tandem_num_requests_running", "tandem_kv_blocks_used", "tandem_kv_blocks_total",
                        "tandem_kv_cache_usage_perc"}),
}  # fmt: skip

# The gateway's request outcomes, each pre-created at 0 so increase()/rate() work from the start.
# "invalid": refused with a 4xx before or while routing (a bad field, an unknown model, too long).
REQUEST_OUTCOMES = ("success", "aborted", "rejected", "timeout", "invalid", "error")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class ServiceMetrics:
    role: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("tandem_requests", "Requests finished, by outcome.", ["outcome"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between consecutive tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("tandem_e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.migrations = Counter("tandem_request_migrations", "Requests moved to another decode worker "
                                  "mid-stream.", registry=r)  # fmt: skip
        self.stalls = Counter("tandem_decode_stalls", "Streams whose decode worker stopped sending and "
                              "answering health checks.", registry=r)  # fmt: skip
        self.running = Gauge("tandem_num_requests_running", "Requests in flight or running.", registry=r)
        self.waiting = Gauge("tandem_num_requests_waiting", "Requests queued.", registry=r)
        self.kv_used = Gauge("tandem_kv_blocks_used", "KV cache blocks in use.", registry=r)
        self.kv_total = Gauge("tandem_kv_blocks_total", "KV cache blocks allocated.", registry=r)
        # The model-server protocol's KVCacheUtilization (Gateway API Inference Extension, llm-d):
        # the fraction 0..1 of blocks held by requests (idle prefix-cache blocks count as free).
        self.kv_usage = Gauge("tandem_kv_cache_usage_perc", "Fraction (0..1) of KV cache blocks held by requests.",
                              registry=r)  # fmt: skip
        self.prefix_hits = Counter("tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.prefix_queries = Counter("tandem_prefix_cache_queries", "Prompt tokens looked up.", registry=r)
        self.preemptions = Counter("tandem_preemptions", "Requests preempted for lack of KV blocks.", registry=r)
        self.prefill_tokens = Counter("tandem_prefill_tokens", "Prompt tokens computed.", registry=r)
        self.kv_bytes = Counter("tandem_kv_transfer_bytes", "KV payload bytes shipped.", ["direction"], registry=r)
        self.kv_seconds = Histogram("tandem_kv_transfer_seconds", "Time to ship one KV chunk.", ["direction"],
                                    buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.kv_failures = Counter("tandem_kv_transfer_failures", "KV transfers that failed.", ["reason"], registry=r)
        self.spec_draft = Counter("tandem_spec_decode_draft_tokens", "Draft tokens proposed.", registry=r)
        self.spec_accepted = Counter("tandem_spec_decode_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.spec_per_pos = Counter("tandem_spec_decode_accepted_tokens_per_position",
                                    "Accepted draft tokens by position in the proposal.", ["position"],
                                    registry=r)  # fmt: skip
        self.spec_cost = Gauge("tandem_spec_decode_draft_token_cost",
                               "Measured price of a draft token, in units of one sequence's share of a plain decode "
                               "step at the current batch (NaN until measured).", registry=r)  # fmt: skip
        self.spec_cost.set(float("nan"))
        if self.role == "gateway":
            for outcome in REQUEST_OUTCOMES:
                self.requests.labels(outcome=outcome)
        self._seen = {"hits": 0, "queries": 0, "preemptions": 0}
        r.register(heap.GcPauseCollector())
        served = SERVED_BY.get(self.role)  # an unknown role (tests) keeps everything
        for metric in list(vars(self).values()):
            if served is not None and isinstance(metric, (Counter, Gauge, Histogram)):
                if metric.describe()[0].name not in served:
                    r.unregister(metric)  # still usable by shared code, just not exposed

    def observe_engine(self, engine) -> None:
        """Refreshes engine-derived metrics; call on the engine thread after a step."""
        kv = engine.kv
        self.kv_total.set(kv.num_blocks)
        self.kv_used.set(kv.num_blocks - kv.num_free_blocks)
        self.kv_usage.set(kv.usage)
        self.running.set(engine.scheduler.num_running)
        self.waiting.set(engine.scheduler.num_waiting)
        for key, value, counter in (
            ("hits", kv.prefix_cache_hits, self.prefix_hits),
            ("queries", kv.prefix_cache_queries, self.prefix_queries),
            ("preemptions", engine.scheduler.num_preemptions, self.preemptions),
        ):
            if value > self._seen[key]:
                counter.inc(value - self._seen[key])
                self._seen[key] = value

    def observe_decode_pool(self, workers) -> None:
        """Gateway: KV utilisation over the decode workers it routes to (registry heartbeats), so
        an endpoint picker in front of gateway replicas reads the same signal a worker exports."""
        total = sum(w.kv_blocks_total for w in workers)
        used = sum(w.kv_blocks_total - w.kv_blocks_free for w in workers)
        self.kv_usage.set(used / total if total else 0.0)

    def serve(self, host: str, port: int) -> None:
        """Serves /metrics on its own port (prefill, decode, draft)."""
        start_http_server(port, addr=host, registry=self.registry)
