"""GET /v1/models and /v1/models/{model}: the LLM models (model_type "llm") ready in Triton, by their served
names (served_names.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from openai_frontend.engine_client import ModelInfo
from openai_frontend.routers.common import require_api_key

router = APIRouter(dependencies=[Depends(require_api_key)])


def _card(model: ModelInfo, created: int, name: str | None = None) -> dict[str, Any]:
    return {
        "id": name or model.name,
        "object": "model",
        "created": created,
        "owned_by": "triton",
        "root": model.root or model.name,  # vLLM's: what the name serves (here the Triton model)
        "max_model_len": model.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    models = await request.app.state.engine.list_models()
    return {"object": "list", "data": [_card(m, request.app.state.started) for m in models]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    info = await request.app.state.engine.model_config(model)  # ModelNotFound -> 404
    return _card(info, request.app.state.started, model)  # any served name is a model of its own id
