"""GET /version, and POST /invocations (SageMaker's one route: a chat or a completions body)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.responses import Response

from openai_frontend.errors import InvalidRequest
from openai_frontend.routers import chat, completions
from openai_frontend.routers.common import BigBodyRoute, parse_big_body, require_api_key
from openai_frontend.schemas import ChatCompletionRequest, CompletionRequest

router = APIRouter(route_class=BigBodyRoute)


@cache
def _version() -> str:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    found = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE)  # (no tomllib before Python 3.11)
    return found.group(1) if found else "unknown"


@router.get("/version")
async def get_version() -> dict[str, str]:
    return {"version": _version()}


@router.post("/invocations", dependencies=[Depends(require_api_key)])
async def invocations(request: Request, body: dict[str, Any] = Body(...)) -> Response:
    """Dispatches on the body as vLLM does: `messages` is a chat completion, `prompt` a completion."""
    if "messages" in body:
        return await chat.create_chat_completion(await parse_big_body(request, ChatCompletionRequest, body), request)
    if "prompt" in body:
        return await completions.create_completion(await parse_big_body(request, CompletionRequest, body), request)
    raise InvalidRequest("the body is neither a chat completion (messages) nor a completion (prompt) request", "body")
