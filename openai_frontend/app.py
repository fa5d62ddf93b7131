"""The FastAPI app: `create_app(engine_client, settings)` wires routers, error handlers and metrics.

Typed errors (errors.py) become OpenAI error JSON here; request validation errors are 400 (not
FastAPI's 422) and name the offending field.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import (
    EngineFailure,
    EngineUnavailable,
    FrontendError,
    InvalidRequest,
    RequestTooLarge,
    RouteNotFound,
)
from openai_frontend.metrics import Metrics
from openai_frontend.request_log import HEADER, RequestIds
from openai_frontend.routers import chat, completions, embeddings, health, misc, models, responses, tokenize
from openai_frontend.service import Service
from openai_frontend.settings import Settings
from openai_frontend.shutdown import Drain
from openai_frontend.tokenizer_api import TokenizerAPI
from openai_frontend.tracing import RequestTracer, otlp_tracer

log = logging.getLogger("openai_frontend")


def create_app(engine: EngineClient, settings: Settings | None = None, tracer: RequestTracer | None = None) -> FastAPI:
    """`tracer`: the spans' tracer (tests); None: the OTLP exporter of `--otlp-traces-endpoint`, if given."""
    settings = settings or Settings()
    metrics = Metrics()
    if tracer is None and settings.otlp_traces_endpoint is not None:
        tracer = otlp_tracer(settings.otlp_traces_endpoint)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # What exists at startup (the libraries' modules, classes, schemas) lives as long as the process:
        # out of the collector's sight, the oldest generation's collections need not walk it every time.
        gc.collect()
        gc.freeze()
        await app.state.service.responses.start()
        yield
        await app.state.service.responses.stop()
        await engine.close()
        if tracer is not None:
            await asyncio.to_thread(tracer.shutdown)  # (exports the spans still queued)

    app = FastAPI(title="LLM serving OpenAI frontend", lifespan=lifespan, docs_url=None, redoc_url=None)
    if isinstance(getattr(engine, "registry", None), CollectorRegistry):
        metrics.extra_registries.append(engine.registry)  # type: ignore[attr-defined]
    engine = settings.served_names.wrap(engine)  # from here on, models go by their served names
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.service = Service(engine, settings, metrics)
    app.state.tokenizer_api = TokenizerAPI(engine, app.state.service.tokenizers)
    app.state.started = int(time.time())
    app.state.drain = Drain(engine, metrics, settings.shutdown_grace_s)
    app.state.drain.hand_over = app.state.service.responses.hand_over
    for module in (completions, chat, embeddings, responses, models, health, tokenize, misc):
        app.include_router(module.router)

    app.add_exception_handler(FrontendError, _frontend_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_credentials=True,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=[HEADER],
        )
    app.add_middleware(_BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(_RefuseWhileDraining, drain=app.state.drain)
    app.add_middleware(_RequestMetrics, metrics=metrics)
    # Outermost: every response has its id, and a traced request's span covers all of it.
    app.add_middleware(RequestIds, log_texts=settings.log_requests, tracer=tracer)
    return app


def _error_response(error: FrontendError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error.to_dict(), status_code=error.status_code, headers=headers)


async def _frontend_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, FrontendError)
    return _error_response(exc)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors: list[Any] = list(exc.errors())

    def where(error: dict[str, Any]) -> str:
        # Pydantic names the union member it tried in the path (`content.str`, `prompt.list[int]`): the
        # user's field is the path without it.
        loc = [str(x) for x in error.get("loc", ()) if not _is_union_member(x)]
        return ".".join(loc[1:] if loc[:1] == ["body"] else loc) or "body"

    unknown = [where(e) for e in errors if e.get("type") == "extra_forbidden"]
    malformed = next((e for e in errors if e.get("type") == "json_invalid"), None)
    not_an_object = any(tuple(e.get("loc", ())) == ("body",) for e in errors)
    if not_an_object:  # e.g. `curl -d` without a JSON content type: FastAPI hands over the raw bytes
        content_type = request.headers.get("content-type", "")
        hint = (
            ""
            if "json" in content_type
            else f" (it came as {content_type or 'no content type'}; send it as application/json)"
        )
        error = InvalidRequest(f"The request body must be a JSON object{hint}")
    elif malformed is not None:  # its loc is a character offset, not a field
        loc = malformed.get("loc", ())
        detail = (malformed.get("ctx") or {}).get("error", malformed.get("msg", "invalid JSON"))
        at = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        error = InvalidRequest(f"The request body is not valid JSON: {detail}{at}")
    elif unknown:
        error = InvalidRequest(f"Unrecognized or unsupported request argument(s): {', '.join(unknown)}", unknown[0])
    elif errors:
        text = "; ".join(f"{where(e)}: {e.get('msg', 'invalid')}" for e in errors[:4])
        error = InvalidRequest(f"Invalid request: {text}", where(errors[0]))
    else:
        error = InvalidRequest("Invalid request")
    return _error_response(error)


def _is_union_member(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return _error_response(RouteNotFound(f"no route for {request.method} {request.url.path}"))
    error = FrontendError(str(exc.detail))
    error.status_code = exc.status_code
    error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error_response(error)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(EngineFailure(f"internal error: {type(exc).__name__}"))


class _RequestMetrics:
    """Counts every HTTP request by endpoint and status (pure ASGI: streaming stays unbuffered)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_request(scope["path"], status)


class _BodyLimit:
    """A body over `max_bytes` is a 413 before it is parsed: at once when Content-Length says so, else as
    soon as the bytes received pass the limit (pure ASGI, so nothing is buffered here)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = RequestTooLarge(
            f"the request body is larger than this server accepts ({self.max_bytes} bytes)", "body"
        )
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _error_response(too_large)(scope, receive, send)
            return
        received = 0
        exceeded = False

        async def counted() -> Message:
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    exceeded = True
                    raise too_large  # stops the body's parsing; the response is replaced below
            return message

        async def send_413_instead(message: Message) -> None:
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":  # the app's reply to the interrupted body
                await _error_response(too_large)(scope, receive, send)

        await self.app(scope, counted, send_413_instead)


_READINESS_PATHS = ("/health/ready", "/ping")


class _RefuseWhileDraining:
    """While shutting down (shutdown.py): readiness and every new request get a 503; liveness and
    metrics still answer."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.drain.draining or scope["path"] in ("/health", "/metrics"):
            await self.app(scope, receive, send)
            return
        if scope["path"] in _READINESS_PATHS:
            response = JSONResponse({"status": "shutting down"}, status_code=503)
        else:
            response = _error_response(EngineUnavailable("the server is shutting down", code="shutting_down"))
        await response(scope, receive, send)
