"""Request spans (openai_frontend/tracing.py) over the fake engine, exported to the SDK's InMemorySpanExporter."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from openai_frontend.app import create_app
from openai_frontend.errors import EngineFailure
from openai_frontend.settings import Settings, parse_settings
from openai_frontend.tracing import SPAN_NAME, RequestTracer, otlp_tracer
from protocol import RequestTimings
from tests.fake_engine import FAKE_MODEL, FAKE_TIMINGS, FakeEngineClient, scripted_steps

MODEL = FAKE_MODEL.name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0.5}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


def client(engine: FakeEngineClient, exporter: InMemorySpanExporter | None) -> httpx.AsyncClient:
    tracer = None
    if exporter is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))  # exported as each span ends
        tracer = RequestTracer(provider.get_tracer("test"), provider.shutdown)
    app = create_app(engine, Settings(), tracer=tracer)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_a_chat_request_is_one_span_with_the_genai_attributes(exporter) -> None:
    engine = FakeEngineClient()
    async with client(engine, exporter) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "req-1"})
    assert r.status_code == 200
    [span] = exporter.get_finished_spans()
    assert span.name == SPAN_NAME and span.kind is SpanKind.SERVER and span.parent is None
    a = span.attributes
    assert a["gen_ai.request.id"] == "req-1" and a["gen_ai.request.model"] == MODEL
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (3, 0.5)
    assert (a["gen_ai.request.top_p"], a["gen_ai.request.n"]) == (1.0, 1)
    assert a["gen_ai.usage.prompt_tokens"] > 0 and a["gen_ai.usage.completion_tokens"] == 3
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.latency.time_in_queue"] == FAKE_TIMINGS.queued_s
    assert a["gen_ai.latency.time_in_model_prefill"] == FAKE_TIMINGS.prefill_s
    assert a["gen_ai.latency.time_in_model_decode"] == FAKE_TIMINGS.decode_s
    assert 0 <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["http.response.status_code"] == 200 and a["url.path"] == "/v1/chat/completions"
    assert span.status.status_code is StatusCode.UNSET


async def test_the_engine_phases_are_events_in_order_within_the_span(exporter) -> None:
    async with client(FakeEngineClient(), exporter) as c:
        await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
    [span] = exporter.get_finished_spans()
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
    times = [e.timestamp for e in span.events]
    assert span.start_time <= times[0] <= times[1] <= times[2] <= times[3] <= span.end_time
    # The fake engine's phases are longer than the request took here: counted back from the last message,
    # they would start before the request arrived, so they start with the span.
    assert times[0] == span.start_time


async def test_phases_are_placed_back_from_the_last_message(exporter) -> None:
    short = RequestTimings(queued_s=0.0, prefill_s=0.0, decode_s=0.0)
    engine = FakeEngineClient(lambda prompt, params: [0.05, *scripted_steps([["a"]], timings=short)])
    async with client(engine, exporter) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    [span] = exporter.get_finished_spans()
    times = [e.timestamp for e in span.events]
    assert len(set(times)) == 1 and times[0] - span.start_time >= 50_000_000  # (after the engine's 50 ms)


async def test_a_client_traceparent_is_the_parent_and_triton_gets_the_spans_context(exporter) -> None:
    engine = FakeEngineClient()
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    async with client(engine, exporter) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}, headers=headers)
    [span] = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span.parent.is_remote
    own = f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    assert [call.headers for call in engine.calls] == [{"traceparent": own, "tracestate": "vendor=1"}] * 2
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length", "length")


async def test_embeddings_and_failed_requests_have_spans_and_other_routes_none(exporter) -> None:
    engine = FakeEngineClient(lambda prompt, params: [EngineFailure("boom")])
    async with client(engine, exporter) as c:
        assert (await c.post("/v1/embeddings", json={"model": MODEL, "input": "one"})).status_code == 200
        assert (await c.post("/v1/chat/completions", json=CHAT)).status_code == 500
        assert (await c.get("/v1/models")).status_code == 200
        assert (await c.get("/health")).status_code == 200
    embed, failed = exporter.get_finished_spans()
    assert embed.attributes["url.path"] == "/v1/embeddings"
    assert embed.attributes["gen_ai.usage.completion_tokens"] == 0
    assert embed.attributes["gen_ai.latency.time_in_model_decode"] == 0.0
    assert embed.attributes["gen_ai.latency.e2e"] >= 0 and "gen_ai.latency.time_to_first_token" not in embed.attributes
    assert [e.name for e in embed.events] == ["queued", "scheduled", "finished"]  # no token, no first token
    assert failed.status.status_code is StatusCode.ERROR and failed.attributes["http.response.status_code"] == 500
    assert failed.events == ()  # nothing was heard from the engine


async def test_without_a_tracer_there_are_no_spans_and_no_headers(exporter) -> None:
    engine = FakeEngineClient()
    async with client(engine, None) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"traceparent": TRACEPARENT})
    assert r.status_code == 200 and engine.calls[0].headers is None
    assert exporter.get_finished_spans() == ()


def test_the_flag_and_the_sdk_only_when_asked_for() -> None:
    assert parse_settings([]).otlp_traces_endpoint is None
    assert parse_settings(["--otlp-traces-endpoint", "http://c:4317"]).otlp_traces_endpoint == "http://c:4317"
    # A frontend without the flag never imports the SDK (nothing of it runs per request).
    code = (
        "import sys; from openai_frontend.app import create_app; from tests.fake_engine import FakeEngineClient; "
        "create_app(FakeEngineClient()); print(any(m.startswith('opentelemetry.sdk') for m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"


def test_only_the_grpc_protocol_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ValueError, match="grpc only"):
        otlp_tracer("http://localhost:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-frontend")
    tracer = otlp_tracer("http://127.0.0.1:1")  # (nothing is sent before a span ends)
    try:
        assert tracer._tracer.resource.attributes["service.name"] == "my-frontend"
    finally:
        tracer.shutdown()
