"""POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's tokenizer endpoints)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from openai_frontend.routers.common import BigBodyRoute, parse_big_body, require_api_key
from openai_frontend.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=BigBodyRoute)


@router.post("/tokenize")
async def tokenize(request: Request, body: dict[str, Any] = Body(...)) -> Response:
    schema = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return _json(await request.app.state.tokenizer_api.tokenize(await parse_big_body(request, schema, body)))


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return _json(await request.app.state.tokenizer_api.detokenize(body))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None) -> dict[str, Any]:
    return await request.app.state.tokenizer_api.tokenizer_info(model)


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")
