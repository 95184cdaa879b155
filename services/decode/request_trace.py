"""Decode's spans of one Generate call, recorded from timestamps taken in the servicer.

    decode.generate (SERVER; parent: the gateway's request span, from the call's metadata)
      ├─ decode.queue_wait   arrival -> the request's first token exists on decode
      │                      (REMOTE: waiting for prefill's KV; LOCAL: engine queue + local prefill)
      └─ decode.generation   first token -> last token (gen_ai.usage.output_tokens)

The engine thread never sees OTel: the servicer notes times as outputs arrive. The span context
of every traced request is kept in `active` while it runs, so the draft proposer (engine
thread) can link its batched Propose span to the requests it serves.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from opentelemetry.trace import SpanContext, SpanKind

from common.engine.llm_engine import CompletionOutput
from services.runtime import tracing


class GenerateTrace:
    def __init__(self, servicer_context: Any, call: Any, active: MutableMapping[str, SpanContext]) -> None:
        self.span = tracing.start_span("decode.generate", tracing.context_from_grpc(servicer_context),
                                       kind=SpanKind.SERVER)  # fmt: skip
        self.recording = self.span.is_recording()
        self.request_id = call.request_id
        self.active = active
        if not self.recording:
            return
        self.start_ns = self.span.start_time or tracing.now_ns()
        self.first_ns: int | None = None
        self.num_tokens = 0
        self.finish_reasons: dict[int, str] = {}
        self.active[call.request_id] = self.span.get_span_context()
        tracing.set_attributes(self.span, {
            **tracing.genai_request_attributes("", call.params, len(call.prompt_token_ids)),
            "gen_ai.request.model": None,
            "tandem.request_id": call.request_id,
            "tandem.kv_source.requested": "remote" if call.remote else "local",
        })  # fmt: skip

    def on_output(self, out: CompletionOutput) -> None:
        if not self.recording:
            return
        if self.first_ns is None:
            self.first_ns = tracing.now_ns()
        self.num_tokens += len(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish_reasons[out.index] = out.finish_reason

    def fail(self, error: BaseException) -> None:
        tracing.mark_error(self.span, error)

    def end(self, info: Any) -> None:
        if not self.recording:
            self.span.end()
            return
        self.active.pop(self.request_id, None)
        end_ns = tracing.now_ns()
        ctx = tracing.context_of(self.span)
        first_ns = self.first_ns or end_ns
        source = "remote" if info.remote_kv_used else "local"
        tracing.record_span("decode.queue_wait", ctx, self.start_ns, first_ns, {"tandem.kv_source": source})
        if self.first_ns is not None:
            tracing.record_span("decode.generation", ctx, first_ns, end_ns, {"gen_ai.usage.output_tokens": self.num_tokens})
        reasons = [self.finish_reasons[i] for i in sorted(self.finish_reasons)]
        tracing.set_attributes(self.span, {
            "tandem.kv_source": source,
            "gen_ai.usage.output_tokens": self.num_tokens,
            "gen_ai.response.finish_reasons": reasons or None,
            "tandem.num_cached_tokens": info.prefill_cached_tokens if info.remote_kv_used else None,
        })  # fmt: skip
        self.span.end(end_time=end_ns)
