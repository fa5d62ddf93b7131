"""Prometheus metrics of the frontend, in a registry of its own (one per app, so tests can make many).

Served at GET /metrics in the Prometheus text format. The engine's own metrics (KV blocks, batch
size) are Triton's, on Triton's metrics port.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

# A whole generation runs far longer than one token: its buckets go on where the token buckets end.
_E2E_BUCKETS = (*_LATENCY_BUCKETS, 160.0, 320.0, 640.0, 1280.0)

# Paths whose requests are counted under their own label; everything else is "other".
_ENDPOINTS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions/batch",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/models",
    "/invocations",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/version",
    "/health",
    "/health/ready",
    "/ping",
    "/metrics",
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.extra_registries: list[CollectorRegistry] = []  # e.g. the server pool's per-server metrics
        r = self.registry
        self.requests = Counter(
            "frontend_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("frontend_prompt_tokens", "Prompt tokens of finished engine requests", registry=r)
        self.generation_tokens = Counter("frontend_generation_tokens", "Tokens generated (sent to clients)", registry=r)
        self.time_to_first_token = Histogram(
            "frontend_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "frontend_inter_token_latency_seconds",
            "Between two consecutive responses of one sequence, per token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "frontend_e2e_request_latency_seconds",
            "From request arrival to the end of its engine work (finished, failed or cancelled)",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.embedding_inputs = Counter(
            "frontend_embedding_inputs", "Inputs embedded (vectors returned by /v1/embeddings)", registry=r
        )
        self.requests_in_flight = Gauge("frontend_requests_in_flight", "Generation requests being served", registry=r)
        self.in_flight = 0  # the gauge's value, readable (graceful shutdown waits for it to reach 0)
        self.integrity_violations = Counter(
            "frontend_stream_integrity_violations",
            "Triton responses that broke step order or came after a finish",
            registry=r,
        )

    def observe_request(self, path: str, status: int) -> None:
        if path.startswith("/v1/models/"):
            endpoint = "/v1/models/{model}"
        elif path.startswith("/v1/responses/"):  # retrieve, delete, cancel, input_items: one label
            endpoint = "/v1/responses/{response_id}"
        else:
            endpoint = path if path in _ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return b"".join(generate_latest(r) for r in (self.registry, *self.extra_registries))
