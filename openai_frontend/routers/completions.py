"""POST /v1/completions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from openai_frontend.routers.common import (
    BigBodyRoute,
    ModelResponse,
    cancel_on_disconnect,
    require_api_key,
    service,
    sse_response,
)
from openai_frontend.schemas import CompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=BigBodyRoute)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    svc = service(request)
    if body.stream:
        return sse_response(await cancel_on_disconnect(request, svc.completions.stream(body)))
    return ModelResponse(await cancel_on_disconnect(request, svc.completions.response(body)))
