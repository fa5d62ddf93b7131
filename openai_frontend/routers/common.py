"""What the routers share: the service from app state, big bodies parsed off the event loop, API-key
check, disconnect handling, SSE, and the JSON response of a response model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import json.scanner
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from openai_frontend.errors import (
    AuthenticationFailed,
    ClientDisconnected,
    EngineFailure,
    FrontendError,
    InvalidRequest,
)
from openai_frontend.responses import OpenAIBaseModel, json_body, json_text
from openai_frontend.service import Service

log = logging.getLogger("openai_frontend")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# Request bodies past this size are parsed and validated on the prompt threads (tokenizers.py): a long
# token-id prompt would hold the event loop, and every other request with it, while it is parsed; a smaller
# body takes less time than the hop to a thread and back.
BODY_INLINE_BYTES = 256 * 1024


def service(request: Request) -> Service:
    return request.app.state.service


def parse_body(schema: type[M], body: dict[str, Any]) -> M:
    """Validate a JSON body against the schema a route picked from its content (errors as FastAPI's own)."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


async def parse_big_body(request: Request, schema: type[M], body: dict[str, Any]) -> M:
    """parse_body, on a prompt thread when the request's body is big."""
    if len(await request.body()) > BODY_INLINE_BYTES:  # (read already: FastAPI parsed it)
        return await service(request).tokenizers.run_on_thread(parse_body, schema, body)
    return parse_body(schema, body)


class BigBodyRoute(APIRoute):
    """A route whose JSON body, past BODY_INLINE_BYTES, is parsed and validated on a prompt thread, with the
    same errors as FastAPI's parse and validation on the event loop (which smaller bodies keep). The
    endpoint, its dependencies and the OpenAPI document are any route's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_field = self.body_field
        if body_field is None:
            return handler

        async def handle(request: Request) -> Response:
            if _may_be_big_json(request):
                try:
                    body = await request.body()
                except Exception:  # noqa: BLE001 - FastAPI's own read answers it as it would (400, or the 413)
                    return await handler(request)
                if len(body) > BODY_INLINE_BYTES:
                    parsed = await service(request).tokenizers.run_on_thread(_parse_and_validate, body_field, body)
                    if parsed is not _FASTAPI_DECIDES:
                        # FastAPI takes the body from Starlette's cache of the parsed JSON, and its validation
                        # passes a model instance through as it is.
                        request._json = parsed  # type: ignore[attr-defined]
            return await handler(request)

        return handle


_FASTAPI_DECIDES = object()


def _may_be_big_json(request: Request) -> bool:
    """A body FastAPI parses as JSON (its content type says so) that is not known to be small."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != "application/json" and not (
        content_type.startswith("application/") and content_type.endswith("+json")
    ):
        return False
    length = request.headers.get("content-length", "")
    return not length.isdigit() or int(length) > BODY_INLINE_BYTES


def _parse_and_validate(field: Any, body: bytes) -> Any:
    """What FastAPI does with a JSON body (fastapi.routing.get_request_handler, then its validation of the
    body parameter), with its errors; _FASTAPI_DECIDES for a body that is not JSON text at all (bad UTF-8,
    nesting past the recursion limit), whose answer FastAPI gives."""
    try:
        data = json.loads(body, cls=_decoder_for(body), parse_int=_parse_int)
    except json.JSONDecodeError as e:
        error = {"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([error | {"ctx": {"error": e.msg}}], body=e.doc) from None
    except (ValueError, RecursionError):
        return _FASTAPI_DECIDES
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        # (The errors' inputs would keep the body alive to be freed on the loop's thread, all at once.)
        errors = [{k: v for k, v in error.items() if k != "input"} for error in errors]
        _free_gradually(data)
        raise RequestValidationError(errors)
    return value


class _InterruptibleDecoder(json.JSONDecoder):
    """json's decoder with its Python scanner: objects and arrays are read by Python code (each string
    still by the C scanstring), so the thread gives up the GIL every switch interval while it parses."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(object_pairs_hook=_bounded_object, **kwargs)
        self.memo = _NoMemo()  # (the scanner clears its memo of every key in one call at the end)
        self.scan_once = json.scanner.py_make_scanner(self)


class _NoMemo(dict):
    """A memo that keeps nothing: each key stays its own string."""

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return default


MAX_OBJECT_KEYS = 65536  # keys of one JSON object in a body (making a dict of them is one C call)
_FREE_CHUNK = 4096


def _bounded_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len(pairs) > MAX_OBJECT_KEYS:
        _free_gradually(pairs)
        raise InvalidRequest(f"A JSON object in the request body holds at most {MAX_OBJECT_KEYS} keys")
    return dict(pairs)


def _free_gradually(value: Any) -> None:
    """Empties a parsed body a chunk at a time, its big containers first: freeing millions of objects at
    once is one C call that holds the GIL, wherever it happens."""
    stack = [value]
    while stack:
        item = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else ()
        stack.extend(c for c in children if isinstance(c, list | dict | tuple) and len(c) > _FREE_CHUNK)
        if isinstance(item, list):  # (its big children are on the stack: deleting them here frees nothing yet)
            while item:
                del item[-_FREE_CHUNK:]


# The C parser reads a whole body in one call that holds the GIL, and calls into Python only for numbers
# (_parse_int). Past this many strings, keys, nulls and booleans the event loop's thread would wait for
# it (a key costs about a microsecond, a string tens of nanoseconds), so such a body is read by the Python
# scanner instead: slower, on a prompt thread at nice 10, and never holding the loop.
C_PARSER_MAX_VALUES = 65536


def _decoder_for(body: bytes) -> type[json.JSONDecoder]:
    """The decoder for `body`, judged by an upper bound of its values other than numbers, counted in bytes
    (quotes and colons inside strings count too: a body of long texts may take the Python scanner, whose
    strings are C's all the same)."""
    count = body.count
    values = count(b'"') // 2 + count(b":") + count(b"null") + count(b"true") + count(b"false")
    return _InterruptibleDecoder if values > C_PARSER_MAX_VALUES else json.JSONDecoder


def _parse_int(text: str) -> int:
    """json's parse_int, in Python: the C parser holds the GIL for a whole body, so without a call into
    Python now and then the event loop's thread would wait for the parse all the same. (Numbers are the
    bulk of big bodies: token ids.)"""
    return int(text)


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
