"""What the e2e tests that run servers of their own share: tritonserver and the frontend started on a
repository of their own (scripts.servers.copy_model_repository), and an SSE stream read to its end."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from scripts.servers import REPO_ROOT, Frontend, TritonServer, free_port

LOGS = REPO_ROOT / "artifacts" / "test-logs"


@contextlib.contextmanager
def running_servers(repository: Path, name: str, **triton_args) -> Iterator[tuple[TritonServer, Frontend]]:
    """tritonserver on `repository` and a frontend on it, on free ports (logs: artifacts/test-logs/*-NAME.log)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          model_repository=repository, **triton_args)  # fmt: skip
    triton.start(log_path=LOGS / f"tritonserver-{name}.log")
    frontend = Frontend(triton.grpc_url, port=free_port())
    try:
        frontend.start(log_path=LOGS / f"frontend-{name}.log")
        yield triton, frontend
    finally:
        frontend.stop()
        triton.stop()


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
