"""--otlp-traces-endpoint on the real servers: a frontend beside the shared one, on the shared tritonserver,
exports its request spans to an OTLP/gRPC receiver served here (opentelemetry-proto's TraceService); its
access log lines carry the engine's phases (docs/frontend.md, "Tracing")."""

from __future__ import annotations

import json
import tempfile
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from scripts.servers import Frontend, free_port
from tests.e2e.helpers import LOGS

TRACE_ID = "5b8efff798038103d269b633813fc60c"
PARENT_SPAN_ID = "eee19b7ec3c1b174"
TTFT = "gen_ai.latency.time_to_first_token"
LATENCIES = (
    "gen_ai.latency.time_in_queue",
    TTFT,
    "gen_ai.latency.e2e",
    "gen_ai.latency.time_in_model_prefill",
    "gen_ai.latency.time_in_model_decode",
)


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """What an OpenTelemetry collector's OTLP/gRPC receiver answers: every span exported, kept."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # (the gRPC service's method name)
        with self._lock:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while len(self.spans) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            return list(self.spans)


def value(any_value) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


def attributes(span) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in span.attributes}


@pytest.fixture(scope="module")
def traced(servers):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    log = LOGS / "frontend-tracing.log"
    args = [
        "--state-dir",
        tempfile.mkdtemp(prefix="frontend-state-"),
        "--otlp-traces-endpoint",
        f"http://127.0.0.1:{port}",
    ]
    # The batch processor exports every 100 ms instead of every 5 s.
    frontend = Frontend(
        servers.triton.grpc_url, port=free_port(), extra_args=args, extra_env={"OTEL_BSP_SCHEDULE_DELAY": "100"}
    )
    frontend.start(log_path=log)
    try:
        yield frontend, receiver, log
    finally:
        frontend.stop()
        server.stop(grace=None)


def test_one_span_per_request_with_its_id_tokens_latencies_and_the_clients_trace(traced, servers) -> None:
    frontend, receiver, log = traced
    model = servers.model
    traceparent = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        chat = http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            headers={"X-Request-Id": "trace-chat", "traceparent": traceparent},
        )
        body = {"model": model, "prompt": "One, two,", "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 1}
        completion = http.post("/v1/completions", json=body, headers={"X-Request-Id": "trace-cmpl"})
        embedding = http.post(
            "/v1/embeddings", json={"model": model, "input": "hello"}, headers={"X-Request-Id": "trace-embd"}
        )
        models = http.get("/v1/models")
    assert chat.status_code == completion.status_code == embedding.status_code == models.status_code == 200

    spans = {attributes(s)["gen_ai.request.id"]: s for s in receiver.wait_for(3)}
    assert sorted(spans) == ["trace-chat", "trace-cmpl", "trace-embd"]  # one each; none for /v1/models
    assert {s.name for s in spans.values()} == {"llm_request"}
    for request_id, response in (("trace-chat", chat), ("trace-cmpl", completion), ("trace-embd", embedding)):
        span, usage = spans[request_id], response.json()["usage"]
        a = attributes(span)
        assert a["gen_ai.request.model"] == model
        assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.completion_tokens"] == usage.get("completion_tokens", 0)
        tokens = bool(usage.get("completion_tokens"))  # (the embedding has none: no first token)
        latencies = [name for name in LATENCIES if tokens or name != TTFT]
        assert all(a[name] >= 0 for name in latencies) and (TTFT in a) == tokens, a
        phases = ["queued", "scheduled", "first_token", "finished"] if tokens else ["queued", "scheduled", "finished"]
        assert [e.name for e in span.events] == phases
        times = [span.start_time_unix_nano, *(e.time_unix_nano for e in span.events), span.end_time_unix_nano]
        assert times == sorted(times)
    chat_attributes, completion_attributes = attributes(spans["trace-chat"]), attributes(spans["trace-cmpl"])
    assert chat_attributes["gen_ai.request.max_tokens"] == 4
    assert chat_attributes["gen_ai.latency.time_to_first_token"] <= chat_attributes["gen_ai.latency.e2e"]
    assert completion_attributes["gen_ai.request.n"] == 2 and completion_attributes["gen_ai.request.temperature"] == 0.8
    assert len(completion_attributes["gen_ai.response.finish_reasons"]) == 2
    assert attributes(spans["trace-embd"])["gen_ai.latency.time_in_model_decode"] == 0

    # The client's trace goes on: its trace id, its span the parent; the others start traces of their own.
    assert spans["trace-chat"].trace_id.hex() == TRACE_ID
    assert spans["trace-chat"].parent_span_id.hex() == PARENT_SPAN_ID
    assert spans["trace-cmpl"].trace_id.hex() != TRACE_ID and not spans["trace-cmpl"].parent_span_id

    # The access log lines of the same requests carry the engine's phases.
    lines = {}
    for text in log.read_text().splitlines():
        if text.startswith("{") and '"request_id"' in text:
            line = json.loads(text)
            lines[line["request_id"]] = line
    for request_id in spans:
        line = lines[request_id]
        assert all(line[name] >= 0 for name in ("queue_s", "prefill_s", "decode_s")), line
        assert line["queue_s"] + line["prefill_s"] + line["decode_s"] <= line["duration_s"]
