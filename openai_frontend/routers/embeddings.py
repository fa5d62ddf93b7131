"""POST /v1/embeddings."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from openai_frontend.embedding_schemas import EmbeddingRequest
from openai_frontend.routers.common import BigBodyRoute, ModelResponse, cancel_on_disconnect, require_api_key, service

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=BigBodyRoute)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return ModelResponse(await cancel_on_disconnect(request, service(request).embeddings.response(body)))
