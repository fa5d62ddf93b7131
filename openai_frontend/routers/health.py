"""GET /health (the frontend is up), /health/ready and SageMaker's /ping (Triton and a model ready), and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/health/ready")
@router.api_route("/ping", methods=["GET", "POST"])  # SageMaker's health check, beside /invocations (as vLLM's)
async def ready(request: Request) -> JSONResponse:
    if await request.app.state.engine.ready():
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": "not ready"}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
