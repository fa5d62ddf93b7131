"""Typed errors of the frontend and their HTTP form: a status code and OpenAI's error JSON.

Every layer raises one of these (the engine client, the service, the routers); only the app's
exception handlers and the SSE edge turn them into `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
from typing import Any

STUB_DEAD = "is not healthy"


class FrontendError(Exception):
    """Base: a failure the client is told about, with its HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "server_error"
    default_code: str | None = None
    default_retry_after_s: int | None = None

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, *, retry_after_s: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code
        self.retry_after_s = retry_after_s or self.default_retry_after_s  # sent as the Retry-After header

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(FrontendError):
    """The request is malformed or asks for something unsupported (also the engine's refusals)."""

    status_code = 400
    error_type = "invalid_request_error"


class RequestTooLarge(FrontendError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class AuthenticationFailed(FrontendError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFound(FrontendError):
    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", "model")


class RouteNotFound(FrontendError):
    status_code = 404
    error_type = "not_found_error"


class ResponseNotFound(FrontendError):
    """A stored response that does not exist (never stored, deleted, or past its retention)."""

    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, response_id: str, param: str | None = None) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param)


class StoreUnreachable(FrontendError):
    """The response store cannot be reached: what needs it is a 503; `store: false` requests go on."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "store_unavailable"
    default_retry_after_s = 5


class ClientDisconnected(FrontendError):
    """The HTTP client went away before the response (nginx's 499); its engine requests are cancelled."""

    status_code = 499
    error_type = "client_closed_request"


class EngineUnavailable(FrontendError):
    """Triton cannot be reached, or the model is not ready (its engine died or is restarting)."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "engine_unavailable"
    default_retry_after_s = 5


class EngineOverloaded(FrontendError):
    """The engine refused the request because its queue is full (wire error type `overloaded`)."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "overloaded"
    default_retry_after_s = 1


class EngineFailure(FrontendError):
    """The engine failed while running the request (Triton error JSON type `engine_error`)."""

    status_code = 500
    error_type = "engine_error"


class StreamIntegrityError(EngineFailure):
    """A Triton response broke the per-sequence invariants (a gap, a repeat, output after finish)."""

    default_code = "stream_integrity_violation"


def from_engine_message(message: str) -> FrontendError:
    """Map the message of a Triton error response to a typed error.

    The model sends `{"type": "invalid_request_error" | "engine_error", "message", "param", "code"}`
    (docs/wire-contract.md). Triton may wrap the model's text in its own prefix, so the JSON object
    is looked for inside the message; anything else is an engine failure with the raw text.
    """
    start, end = message.find("{"), message.rfind("}")
    if 0 <= start < end:
        try:
            data = json.loads(message[start : end + 1])
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("message"), str):
            param = data.get("param") if isinstance(data.get("param"), str) else None
            code = data.get("code") if isinstance(data.get("code"), str) else None
            if data.get("type") == "invalid_request_error":
                return InvalidRequest(data["message"], param, code)
            if data.get("type") == "overloaded":
                return EngineOverloaded(data["message"], param, code)
            return EngineFailure(data["message"], param, code)
    if "unknown model" in message.lower():
        return EngineUnavailable(message, "model")
    if STUB_DEAD in message:  # the Python backend's word for a stub process that died
        return EngineUnavailable(message)
    return EngineFailure(message)
