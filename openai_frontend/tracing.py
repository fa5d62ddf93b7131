"""OpenTelemetry traces of generation requests (`--otlp-traces-endpoint`, vLLM's flag).

One span per HTTP request that generates (completions, chat, embeddings, responses, SageMaker's
invocations), named `llm_request` and with the GenAI semantic conventions' attributes, as vLLM's; the
engine's phases are its events. The span is a child of the client's W3C `traceparent` / `tracestate`
when the request carries them, and its own trace context goes with each engine request to Triton as
gRPC metadata, so that Triton's OpenTelemetry tracing (`--trace-config mode=opentelemetry`) joins the
same trace. Spans leave in batches on the SDK's own thread (BatchSpanProcessor) over OTLP/gRPC.

Off by default: without the flag there is no tracer, the SDK is never imported, and no request does
anything for tracing. With it, the request log's middleware (request_log.py) starts the span when a
request arrives and ends it when its response has ended, its attributes and events read once from the
request's RequestRecord: nothing per token.

The engine's phases are durations of the engine's clock (RequestTimings), and the frontend may run on
another host, so the events are placed on the frontend's clock, counting back from the arrival here of
the last message of the sequence that finished last: `finished` then, `first_token` its `decode_s`
before, `scheduled` its `prefill_s` before that, `queued` its `queued_s` before that (none before the
span's start; no `first_token` for a request that generated no token, as an embedding). The latency
attributes are the request's: `time_in_queue`, `time_in_model_prefill` and `time_in_model_decode` each
the largest of its sequences' (as the access log's `queue_s`, `prefill_s`, `decode_s`),
`time_to_first_token` (none without a token) and `e2e` from the request's arrival.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import Scope

from openai_frontend.request_log import RequestRecord

SPAN_NAME = "llm_request"  # vLLM's
SERVICE_NAME = "llm-openai-frontend"  # OTEL_SERVICE_NAME, when set, names it instead
# The routes whose POSTs generate: each gets a span.
TRACED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/embeddings",
        "/v1/responses",
        "/invocations",
    }
)
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
_TRACE_HEADERS = (b"traceparent", b"tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()


class GenAI:
    """The attribute names (OpenTelemetry's GenAI semantic conventions, as vLLM's SpanAttributes)."""

    REQUEST_ID = "gen_ai.request.id"
    REQUEST_MODEL = "gen_ai.request.model"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_N = "gen_ai.request.n"
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
    LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    LATENCY_E2E = "gen_ai.latency.e2e"
    LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"


@dataclass(frozen=True, slots=True)
class RequestSpan:
    """An open request span, the two clocks at its start, and its trace context for Triton."""

    span: trace.Span
    start_ns: int  # time.time_ns() at the start: the span's own clock
    start_monotonic: float  # time.monotonic() at the same moment: the clock the record's times are on
    headers: dict[str, str]  # traceparent (and tracestate) naming this span

    def ns(self, monotonic: float) -> int:
        """A time.monotonic() reading on the span's clock."""
        return self.start_ns + int((monotonic - self.start_monotonic) * 1e9)


class RequestTracer:
    """Starts and ends the spans of generation requests on `tracer`; `shutdown` flushes what is left."""

    def __init__(self, tracer: Tracer, shutdown: Any = None) -> None:
        self._tracer = tracer
        self._shutdown = shutdown

    @staticmethod
    def traces(scope: Scope) -> bool:
        return scope["method"] == "POST" and scope["path"] in TRACED_PATHS

    def start(self, scope: Scope, start_monotonic: float) -> RequestSpan:
        """The request's span, from now (start_monotonic: time.monotonic() when it arrived)."""
        start_ns = time.time_ns() - int((time.monotonic() - start_monotonic) * 1e9)
        incoming = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS}
        parent = _PROPAGATOR.extract(incoming) if incoming else None
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER, start_time=start_ns)
        span.set_attribute("http.request.method", scope["method"])
        span.set_attribute("url.path", scope["path"])
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
        return RequestSpan(span, start_ns, start_monotonic, headers)

    def end(self, request: RequestSpan, record: RequestRecord, status: int | None, end_monotonic: float) -> None:
        """Sets the span's attributes and events from the request's record and ends it."""
        span = request.span
        attributes: dict[str, Any] = {GenAI.REQUEST_ID: record.request_id}
        if status is not None:
            attributes["http.response.status_code"] = status
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        if record.model is not None:
            attributes[GenAI.REQUEST_MODEL] = record.model
        params = record.params
        if params is not None:
            if params.max_tokens is not None:
                attributes[GenAI.REQUEST_MAX_TOKENS] = params.max_tokens
            attributes[GenAI.REQUEST_TEMPERATURE] = params.temperature
            attributes[GenAI.REQUEST_TOP_P] = params.top_p
            attributes[GenAI.REQUEST_N] = params.n
        e2e_s = record.e2e_s
        if record.generated:
            if e2e_s is None:  # (an embedding: its engine work ends with the response)
                e2e_s = end_monotonic - request.start_monotonic
            attributes[GenAI.USAGE_PROMPT_TOKENS] = record.prompt_tokens
            attributes[GenAI.USAGE_COMPLETION_TOKENS] = record.completion_tokens
            attributes[GenAI.RESPONSE_FINISH_REASONS] = [r for r in record.finish_reasons if r is not None]
        for name, seconds in (
            (GenAI.LATENCY_TIME_IN_QUEUE, record.queue_s),
            (GenAI.LATENCY_TIME_TO_FIRST_TOKEN, record.ttft_s),
            (GenAI.LATENCY_E2E, e2e_s),
            (GenAI.LATENCY_TIME_IN_MODEL_PREFILL, record.prefill_s),
            (GenAI.LATENCY_TIME_IN_MODEL_DECODE, record.decode_s),
        ):
            if seconds is not None:
                attributes[name] = seconds
        span.set_attributes(attributes)
        phases = record.engine_phases
        if phases is not None:
            t = phases.timings
            finished = request.ns(phases.received_at)
            first_token = finished - int(t.decode_s * 1e9)
            scheduled = first_token - int(t.prefill_s * 1e9)
            queued = scheduled - int(t.queued_s * 1e9)
            events = [
                ("queued", queued),
                ("scheduled", scheduled),
                ("first_token", first_token),
                ("finished", finished),
            ]
            if not record.completion_tokens:  # (an embedding, or an abort before any token)
                del events[2]
            at = request.start_ns
            for name, when in events:
                at = max(at, when)
                span.add_event(name, timestamp=at)
        span.end(end_time=max(request.ns(end_monotonic), request.start_ns))

    def shutdown(self) -> None:
        """Exports the spans still queued (the SDK's provider, when this tracer made it)."""
        if self._shutdown is not None:
            self._shutdown()


def otlp_tracer(endpoint: str) -> RequestTracer:
    """A tracer exporting to the OTLP/gRPC collector at `endpoint` (e.g. http://localhost:4317; https:// for
    TLS), in batches. The exporter's own OTEL_EXPORTER_OTLP_* variables (headers, timeout, certificates)
    apply; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL may only say grpc (the one exporter installed)."""
    protocol = os.environ.get(PROTOCOL_ENV, "grpc")
    if protocol != "grpc":
        raise ValueError(f"{PROTOCOL_ENV}={protocol!r}: this frontend exports traces over grpc only")
    # Imported here: a frontend without the flag never loads the SDK.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return RequestTracer(provider.get_tracer("openai_frontend"), provider.shutdown)
