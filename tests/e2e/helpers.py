"""What the e2e tests that run servers of their own share: tritonserver and the frontend started on a
repository of their own (scripts.servers.copy_model_repository), and an SSE stream read to its end."""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

import scripts.servers
from scripts.servers import REPO_ROOT, Frontend, TritonServer

LOGS = REPO_ROOT / "artifacts" / "test-logs"


def running_servers(
    repository: Path, name: str, **triton_args
) -> AbstractContextManager[tuple[TritonServer, Frontend]]:
    """tritonserver on `repository` and a frontend on it, on free ports (logs: artifacts/test-logs/*-NAME.log)."""
    return scripts.servers.running_servers(LOGS, f"-{name}", model_repository=repository, **triton_args)


async def read_sse(
    http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None, started_after: int = 2
) -> tuple[list[str], float]:
    """The `data:` payloads of one streamed completion, and when it ended; `started` is set once
    `started_after` of them arrived."""
    events: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None and len(events) == started_after:
                    started.set()
    return events, time.monotonic()
