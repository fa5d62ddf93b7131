"""What the routers share: the service from app state, API-key check, disconnect handling, SSE, and
the JSON response of a response model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from openai_frontend.errors import AuthenticationFailed, ClientDisconnected, EngineFailure, FrontendError
from openai_frontend.responses import OpenAIBaseModel, json_body, json_text
from openai_frontend.service import Service

log = logging.getLogger("openai_frontend")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def service(request: Request) -> Service:
    return request.app.state.service


def parse_body(schema: type[M], body: dict[str, Any]) -> M:
    """Validate a JSON body against the schema a route picked from its content (errors as FastAPI's own)."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def require_api_key(request: Request) -> None:
    """FastAPI dependency of the /v1 routers: 'Authorization: Bearer <key>' when a key is set."""
    key = request.app.state.settings.api_key
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise AuthenticationFailed("Incorrect API key provided.")


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has disconnected (uvicorn's `receive` says so after the request body)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (uvicorn does not cancel handlers).

    Cancelling it closes the engine streams, which cancels the Triton requests; the handler then
    ends with ClientDisconnected (status 499, sent to nobody).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.wait({task})  # let it close its engine streams
    log.info("client disconnected: request cancelled")
    raise ClientDisconnected("client closed the connection")


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops streaming as soon as its client disconnects (uvicorn drops what is
    sent to a gone client and does not cancel the handler) and always closes its body iterator, so the
    engine requests behind it are cancelled at once.

    Starlette's own watches for the disconnect with an anyio task group per response, whose cancel
    scopes cost about a quarter of a short request's Python here; a watcher task that cancels the
    streaming one does the same.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        gone = finished = False

        async def watch_disconnect() -> None:
            nonlocal gone
            await _disconnected(receive)
            if not finished:
                gone = True
                streaming.cancel()

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone:
                raise
        finally:
            finished = True  # (from here on the watcher cancels nothing)
            watcher.cancel()
            if gone:  # our own cancel: taken here if still pending, so that it cannot cut the cleanup short
                streaming.uncancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(0)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if self.background is not None:
            await self.background()


def sse_response(chunks: AsyncIterator[OpenAIBaseModel | dict[str, Any]]) -> StreamingResponse:
    """`data: <json>` per chunk, then `data: [DONE]`; a failure mid-stream becomes `data: {"error": ...}`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json_text(chunk)}\n\n"
        except FrontendError as e:
            log.warning("stream ended with error: %s", e.message)
            yield f"data: {json_text(e.to_dict())}\n\n"
        except Exception as e:  # the client must still get an error event and [DONE]
            log.exception("stream failed")
            yield f"data: {json_text(EngineFailure(f'internal error: {type(e).__name__}').to_dict())}\n\n"
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    return ClosingStreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


class ModelResponse(JSONResponse):
    """A JSONResponse of a response model (encoded by responses.json_body, as JSONResponse encodes a dict)."""

    def render(self, content: OpenAIBaseModel) -> bytes:
        return json_body(content)
