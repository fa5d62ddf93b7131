"""/v1/responses: create (streamed or not, in the background or not), retrieve (or stream from any point),
delete, cancel, and list a response's input items."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from openai_frontend.errors import FrontendError
from openai_frontend.responses_api.runs import Run, sse_frame
from openai_frontend.responses_api.schemas import ResponsesRequest
from openai_frontend.responses_api.service import ResponsesService
from openai_frontend.routers.common import BigBodyRoute, ClosingStreamingResponse, cancel_on_disconnect, require_api_key

log = logging.getLogger("openai_frontend")
router = APIRouter(dependencies=[Depends(require_api_key)], route_class=BigBodyRoute)


def _service(request: Request) -> ResponsesService:
    return request.app.state.service.responses


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    svc = _service(request)
    run = await cancel_on_disconnect(request, svc.create(body))
    if body.stream:
        return _sse(_run_frames(run), after_seq=-1)
    if body.background:
        return JSONResponse(run.builder.response)
    try:
        await cancel_on_disconnect(request, run.wait())
    finally:
        if not run.done:  # the client left: its response is cancelled
            run.stop()
    if run.error is not None:
        raise run.error
    return JSONResponse(run.builder.response)


async def _run_frames(run: Run) -> AsyncIterator[str]:
    """The creating client's stream: a foreground response ends with its client (cancelled), a background
    one goes on without it."""
    try:
        async for _, frame in run.frames_after(-1):
            yield frame
    finally:
        if not run.background and not run.done:
            run.stop()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1)] = None,
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> Response:
    svc = _service(request)
    if stream:
        after = -1 if starting_after is None else starting_after
        return _sse(await svc.events(response_id, after), after_seq=after)
    return JSONResponse(await svc.retrieve(response_id))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    return JSONResponse(await _service(request).delete(response_id))


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    return JSONResponse(await _service(request).cancel(response_id))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    request: Request,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    include: Annotated[list[str] | None, Query(alias="include[]")] = None,
) -> Response:
    return JSONResponse(await _service(request).input_items(response_id, limit, order, after))


def _sse(frames: AsyncIterator[str], after_seq: int) -> StreamingResponse:
    """The frames as they come; a failure while following (the store unreachable) ends the stream with an
    `error` event."""

    async def body() -> AsyncIterator[str]:
        seq = after_seq
        try:
            async for frame in frames:
                seq += 1
                yield frame
        except FrontendError as e:
            log.warning("response stream ended with error: %s", e.message)
            yield _error_frame(e.code or e.error_type, e.message, seq + 1)
        except Exception as e:
            log.exception("response stream failed")
            yield _error_frame("server_error", f"internal error: {type(e).__name__}", seq + 1)
        finally:
            await frames.aclose()  # type: ignore[attr-defined]

    return ClosingStreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _error_frame(code: str, message: str, sequence_number: int) -> str:
    event: dict[str, Any] = {
        "type": "error",
        "code": code,
        "message": message,
        "param": None,
        "sequence_number": sequence_number,
    }
    return sse_frame("error", json.dumps(event))
