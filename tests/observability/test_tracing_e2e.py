"""Issue 5, acceptance 1: one request through a real cluster (gateway, prefill, decode, draft)
yields one trace, received by a real OTLP/gRPC receiver: every service's spans share the
client's trace id, every span's parent is in the trace (or is the client's span), KV transfer
hangs under prefill, decode under the gateway, and the GenAI attributes are there."""

from __future__ import annotations

import secrets

from services.launcher.cluster import Cluster
from tests.cluster.cluster_helpers import gateway_channel, post, random_prompts, wait_for
from tests.observability.otlp_receiver import OtlpReceiver, ReceivedSpan

PROMPT = random_prompts((90,), seed=11)[0]  # 2 engine steps of 64 tokens on prefill
MAX_TOKENS = 8
SERVICES = {"tandem-gateway", "tandem-prefill", "tandem-decode", "tandem-draft"}


def _ancestors(span: ReceivedSpan, by_id: dict[str, ReceivedSpan]) -> list[str]:
    names = []
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        names.append(span.name)
    return names


def _one(spans: list[ReceivedSpan], name: str, service: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.service == service]
    assert len(found) == 1, f"{name} on {service}: {len(found)} spans ({[(s.service, s.name) for s in spans]})"
    return found[0]


def test_one_request_one_trace(traced: Cluster, receiver: OtlpReceiver) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0, "top_p": 0.9, "ignore_eos": True}
    reply = post(traced, "/v1/completions", json=body, timeout=120.0,
                 headers={"traceparent": f"00-{trace_id}-{client_span}-01"})  # fmt: skip
    assert reply.status_code == 200, reply.text

    def complete() -> list[ReceivedSpan] | None:
        spans = receiver.spans(trace_id)
        names = {(s.service, s.name) for s in spans}
        done = {("tandem-gateway", "POST /v1/completions"), ("tandem-decode", "decode.generate"),
                ("tandem-prefill", "prefill.request"), ("tandem-draft", "draft.propose")}  # fmt: skip
        return spans if done <= names else None

    spans = wait_for(complete, timeout_s=20, what="spans of every service")
    by_id = {s.span_id: s for s in spans}
    print("\n" + render_tree(spans, client_span))

    assert {s.service for s in spans} == SERVICES
    assert len(by_id) == len(spans), "span ids must be unique"
    for s in spans:  # correctly parented: nothing dangles
        assert s.parent_span_id in by_id or s.parent_span_id == client_span, f"{s.service} {s.name}: orphan"

    root = _one(spans, "POST /v1/completions", "tandem-gateway")
    assert root.parent_span_id == client_span and root.kind == 2  # SERVER
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == traced.spec.model.rstrip("/").rsplit("/", 1)[-1]
    assert attrs["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.request.temperature"] == 0.0 and abs(attrs["gen_ai.request.top_p"] - 0.9) < 1e-9
    assert attrs["gen_ai.usage.input_tokens"] == len(PROMPT)
    assert attrs["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["tandem.outcome"] == "success"

    route = _one(spans, "gateway.route", "tandem-gateway")
    assert route.parent_span_id == root.span_id and route.attributes["tandem.kv_source"] == "remote"
    reserve = _one(spans, "decode.reserve", "tandem-decode")
    assert reserve.parent_span_id == route.span_id

    # decode: under the gateway's request span, queue wait then generation
    generate = _one(spans, "decode.generate", "tandem-decode")
    assert generate.parent_span_id == root.span_id
    assert generate.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert generate.attributes["tandem.kv_source"] == "remote"
    wait, gen = _one(spans, "decode.queue_wait", "tandem-decode"), _one(spans, "decode.generation", "tandem-decode")
    assert wait.parent_span_id == gen.parent_span_id == generate.span_id
    assert wait.end_ns <= gen.start_ns and gen.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS

    # prefill: per-chunk spans, KV transfer under the prefill request, decode's receive under it
    prefill = _one(spans, "prefill.request", "tandem-prefill")
    assert prefill.parent_span_id == root.span_id
    chunks = [s for s in spans if s.name == "prefill.chunk"]
    assert len(chunks) >= 2 and all(c.parent_span_id == prefill.span_id for c in chunks)
    assert sum(c.attributes["tandem.num_new_tokens"] for c in chunks) == len(PROMPT)
    transfer = _one(spans, "kv.transfer", "tandem-prefill")
    assert transfer.parent_span_id == prefill.span_id
    sends = [s for s in spans if s.name == "kv.send_chunk"]
    assert sends and all(s.parent_span_id == transfer.span_id for s in sends)
    assert sum(s.attributes["tandem.kv.bytes"] for s in sends) == transfer.attributes["tandem.kv.bytes"] > 0
    receive = _one(spans, "kv.receive", "tandem-decode")
    assert receive.parent_span_id == transfer.span_id
    assert receive.attributes["tandem.kv.bytes"] == transfer.attributes["tandem.kv.bytes"]

    # draft: one batched propose per decode step, linked to the request, served by the draft
    proposes = [s for s in spans if s.name == "draft.propose" and s.service == "tandem-decode"]
    assert proposes and all(p.parent_span_id == generate.span_id for p in proposes)
    assert all((trace_id, generate.span_id) in p.links for p in proposes)
    served = [s for s in spans if s.name == "draft.propose" and s.service == "tandem-draft"]
    assert served and {s.parent_span_id for s in served} <= {p.span_id for p in proposes}
    for s in spans:
        if s.service != "tandem-gateway":
            assert root.name in _ancestors(s, by_id), f"{s.service} {s.name} does not descend from the request"


def render_tree(spans: list[ReceivedSpan], client_span: str) -> str:
    children: dict[str, list[ReceivedSpan]] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_span_id, []).append(s)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            ms = (s.end_ns - s.start_ns) / 1e6
            lines.append(f"{'  ' * depth}{s.name}  [{s.service}, {ms:.1f} ms]")
            walk(s.span_id, depth + 1)

    walk(client_span, 0)
    return "\n".join(lines)


def test_grpc_generate_joins_the_clients_trace(traced: Cluster, receiver: OtlpReceiver) -> None:
    from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT[:40]),
                                             sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    with gateway_channel(traced) as channel:
        replies = list(generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=60, metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),)))
    assert replies
    spans = wait_for(lambda: (s := receiver.spans(trace_id)) and {x.service for x in s} >= {
        "tandem-gateway", "tandem-decode", "tandem-prefill"} and any(x.name == "decode.generate" for x in s) and s,
        timeout_s=20, what="spans of the gRPC request")  # fmt: skip
    root = _one(spans, "tandem.v1.Generation/Generate", "tandem-gateway")
    assert root.parent_span_id == client_span and root.attributes["gen_ai.usage.output_tokens"] == 4
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_span_id in by_id or s.parent_span_id == client_span for s in spans)
