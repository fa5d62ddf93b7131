"""Request ids and the access log (vLLM's and SGLang's `X-Request-Id`, one JSON line per request).

A client's `X-Request-Id` names its request everywhere: the response id's suffix (`chatcmpl-<id>`,
`cmpl-<id>`), the Triton request id (so Triton's and the engine's logs name it) and the response's
`X-Request-Id` header; a request without one gets a generated id, echoed the same way. The engine keys
requests by their id, so a client's id gets a random suffix in the engine's id (`chatcmpl-<id>-<8 hex>-0`):
two requests in flight with the same id stay two requests.

`RequestIds` (a pure ASGI middleware: streams stay unbuffered) holds the request's `RequestRecord` in a
context variable; the request's Generation fills in its numbers once, when it ends, and the middleware
writes the line on the `openai_frontend.access` logger when the response has ended (streams too). With
`--otlp-traces-endpoint` it also starts the request's span and ends it from the same record (tracing.py).

The engine's phases (`queue_s`, `prefill_s`, `decode_s`: its RequestTimings, docs/wire-contract.md) are,
for a request of several sequences or prompts, each the largest of its sequences': the longest wait, the
slowest prefill, the longest decode (so they need not come from one sequence).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
import uuid
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.errors import InvalidRequest
from protocol import RequestTimings, SamplingParams

if TYPE_CHECKING:
    from openai_frontend.tracing import RequestTracer

HEADER = "X-Request-Id"
_HEADER_KEY = HEADER.lower().encode()
# Printable ASCII without spaces: the id goes into log lines, response ids and Triton's request ids.
_VALID_ID = re.compile(rb"[!-~]{1,128}")
MAX_LOGGED_CHARS = 2048  # --log-requests: each prompt and output is cut to this many characters

access_log = logging.getLogger("openai_frontend.access")


@dataclass(frozen=True, slots=True)
class EnginePhases:
    """The engine's timings of the request's sequence whose last message came last, and when it came
    (time.monotonic() here): where the trace places the engine's phases."""

    timings: RequestTimings
    received_at: float


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request's id and what its generation reports for the access log."""

    request_id: str
    client_given: bool  # the id came in X-Request-Id (so it need not be unique)
    log_texts: bool  # --log-requests: the line carries the prompts and outputs
    generated: bool = False  # an engine generation ran for it
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None  # arrival to the end of the engine work
    queue_s: float | None = None  # the engine's phases, each the largest of the sequences' (None: not measured)
    prefill_s: float | None = None
    decode_s: float | None = None
    engine_phases: EnginePhases | None = None
    finish_reasons: list[str | None] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # What the trace's attributes name (tracing.py): the model as the response names it, the sampling params.
    model: str | None = None
    params: SamplingParams | None = None
    # A traced request's W3C trace context, sent with its engine requests as gRPC metadata (None: not traced).
    trace_headers: Mapping[str, str] | None = None

    def add_engine_timings(self, timings: RequestTimings, received_at: float) -> None:
        """One sequence's engine timings, from its last message, which came at `received_at`."""
        self.queue_s = max(self.queue_s or 0.0, timings.queued_s)
        self.prefill_s = max(self.prefill_s or 0.0, timings.prefill_s)
        self.decode_s = max(self.decode_s or 0.0, timings.decode_s)
        if self.engine_phases is None or received_at >= self.engine_phases.received_at:
            self.engine_phases = EnginePhases(timings, received_at)

    def response_ids(self, prefix: str) -> tuple[str, str]:
        """(the response's id, the engine request id) of a generation with this id prefix."""
        response_id = f"{prefix}-{self.request_id}"
        return response_id, f"{response_id}-{secrets.token_hex(4)}" if self.client_given else response_id

    def fields(self) -> dict[str, Any]:
        """The generation's part of the access log line."""
        if not self.generated:
            return {}
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": _rounded(self.ttft_s),
            "queue_s": _rounded(self.queue_s),
            "prefill_s": _rounded(self.prefill_s),
            "decode_s": _rounded(self.decode_s),
            "finish_reasons": self.finish_reasons,
        }
        if self.log_texts:
            out["prompts"], out["outputs"] = self.prompts, self.outputs
        return out


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


current_request: ContextVar[RequestRecord | None] = ContextVar("current_request", default=None)


def response_ids(prefix: str) -> tuple[str, str]:
    """(response id, engine request id) for a generation of the current HTTP request; outside one
    (a background job, a test calling a service) a generated id."""
    record = current_request.get()
    if record is None:
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        return response_id, response_id
    return record.response_ids(prefix)


def clipped(text: str) -> str:
    return text if len(text) <= MAX_LOGGED_CHARS else text[:MAX_LOGGED_CHARS] + "..."


class RequestIds:
    """Gives every HTTP request its id (the client's X-Request-Id, checked, or a generated one), sends it
    back on every response, and writes the request's access log line when its response has ended.

    A malformed X-Request-Id (over 128 characters, or not printable ASCII) is a 400 naming the header:
    replacing it silently would leave the client grepping logs for an id no line holds. With a tracer, a
    generation request also gets its span (tracing.py), ended when its response has ended."""

    def __init__(self, app: ASGIApp, log_texts: bool, tracer: RequestTracer | None = None) -> None:
        self.app, self.log_texts, self.tracer = app, log_texts, tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        given = next((value for name, value in scope["headers"] if name == _HEADER_KEY), b"")
        valid = not given or _VALID_ID.fullmatch(given) is not None
        client_given = bool(given) and valid
        request_id = given.decode("ascii") if client_given else uuid.uuid4().hex
        record = RequestRecord(request_id, client_given, self.log_texts)
        span = None
        if self.tracer is not None and valid and self.tracer.traces(scope):
            span = self.tracer.start(scope, start)
            record.trace_headers = span.headers
        id_header = (_HEADER_KEY, request_id.encode("ascii"))
        status: int | None = None  # None: the response never started (the client left first)

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        token = current_request.set(record)
        try:
            if valid:
                await self.app(scope, receive, send_with_id)
            else:
                error = InvalidRequest(f"the {HEADER} header must be 1 to 128 printable ASCII characters", HEADER)
                await JSONResponse(error.to_dict(), status_code=error.status_code)(scope, receive, send_with_id)
        finally:
            current_request.reset(token)
            end = time.monotonic()
            if access_log.isEnabledFor(logging.INFO):
                access_log.info(_line(scope, record, status, end - start))
            if span is not None:
                self.tracer.end(span, record, status, end)


def _line(scope: Scope, record: RequestRecord, status: int | None, duration_s: float) -> str:
    client = scope.get("client")
    line = {
        "request_id": record.request_id,
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "client": f"{client[0]}:{client[1]}" if client else None,
        "duration_s": round(duration_s, 6),
        **record.fields(),
    }
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def configure_access_log(level: str) -> None:
    """Prints the access log, bare JSON lines, on stdout beside uvicorn's (which configures only its own
    loggers, so the frontend's would print WARNING and above alone)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access_log.addHandler(handler)
    access_log.setLevel(level.upper())
    access_log.propagate = False
