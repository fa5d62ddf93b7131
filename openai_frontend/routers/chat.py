"""POST /v1/chat/completions, and vLLM's POST /v1/chat/completions/batch (the same, for batches only)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from openai_frontend.errors import InvalidRequest
from openai_frontend.routers.common import (
    BigBodyRoute,
    ModelResponse,
    cancel_on_disconnect,
    require_api_key,
    service,
    sse_response,
)
from openai_frontend.schemas import ChatCompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=BigBodyRoute)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    svc = service(request)
    if body.stream:
        return sse_response(await cancel_on_disconnect(request, svc.chat.stream(body)))
    return ModelResponse(await cancel_on_disconnect(request, svc.chat.response(body)))


@router.post("/v1/chat/completions/batch")
async def create_batch_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    if not body.batched:
        raise InvalidRequest("messages must be a list of conversations (each a list of messages)", "messages")
    return await create_chat_completion(body, request)
