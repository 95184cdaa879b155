"""The gateway's span of one request (the root of its trace inside Tandem) and what it learns.

    REST `POST /v1/completions` / gRPC `tandem.v1.Generation/Generate`   (SERVER; parent: the
        client's traceparent, if any) carries the GenAI request/usage attributes; its context
        goes out in the metadata of every call made for the request (Reserve, Generate,
        Prefill, Abort). Off (no OTel provider): every method returns at once.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import SpanKind

from services.gateway.request_types import GenerationUpdate
from services.runtime import tracing


class RequestTrace:
    def __init__(self, name: str, parent: Context | None, req: Any) -> None:
        self.span = tracing.start_span(name, parent, kind=SpanKind.SERVER)
        self.context: Context | None = tracing.context_of(self.span)
        self._finish_reasons: dict[int, str] = {}
        if self.span.is_recording():
            tracing.set_attributes(self.span, {
                **tracing.genai_request_attributes(req.model, req.params, len(req.prompt_token_ids)),
                "gen_ai.operation.name": "chat" if name.endswith("chat/completions") else "text_completion",
                "tandem.request_id": req.request_id,
            })  # fmt: skip

    def metadata(self) -> tracing.Metadata | None:
        return tracing.grpc_metadata(self.context)

    def observe(self, update: GenerationUpdate) -> None:
        if not self.span.is_recording():
            return
        for c in update.choices:
            if c.finish_reason is not None:
                self._finish_reasons[c.index] = c.finish_reason
        if update.usage is not None:
            tracing.set_attributes(self.span, {
                "gen_ai.usage.input_tokens": update.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": update.usage.completion_tokens,
                "tandem.num_cached_tokens": update.usage.cached_tokens,
            })  # fmt: skip

    def end(self, outcome: str, error: BaseException | None = None) -> None:
        if self.span.is_recording():
            reasons = [self._finish_reasons[i] for i in sorted(self._finish_reasons)]
            tracing.set_attributes(self.span, {"tandem.outcome": outcome,
                                               "gen_ai.response.finish_reasons": reasons or None})  # fmt: skip
            if error is not None and outcome not in ("success", "aborted"):
                tracing.mark_error(self.span, error)
        self.span.end()
