"""Graceful shutdown: SIGTERM (what Kubernetes and `make serve` send) drains instead of dropping.

1. At once: `/health/ready` answers 503 and every new request gets a 503 with Retry-After; the port
   stays open, so a load balancer sees the change instead of refused connections.
2. Background responses are left to their leases, for another frontend to continue (docs/responses.md);
   open requests go on for up to the grace period (`--shutdown-grace-s`, default 30 s).
3. What is still open then ends with an error event and [DONE] (a non-streamed request with a 503);
   the engine requests are cancelled, so Triton frees their KV blocks.
4. uvicorn stops. A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from openai_frontend.engine_client import EngineClient
from openai_frontend.metrics import Metrics

log = logging.getLogger("openai_frontend")


class Drain:
    def __init__(self, engine: EngineClient, metrics: Metrics, grace_s: float) -> None:
        self.engine, self.metrics, self.grace_s = engine, metrics, grace_s
        self.draining = False
        self.hand_over: Callable[[], None] = lambda: None  # work that another frontend continues (Responses API)

    async def run(self) -> None:
        self.draining = True
        self.hand_over()
        log.warning(
            "shutting down: %d requests open, waiting up to %g s for them", self.metrics.in_flight, self.grace_s
        )
        deadline = time.monotonic() + self.grace_s
        while self.metrics.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.metrics.in_flight:
            ended = self.engine.abort_all("the server is shutting down; this request was not completed")
            log.warning("grace period over: ended %d open engine streams", ended)
            deadline = time.monotonic() + 5
            while self.metrics.in_flight and time.monotonic() < deadline:  # let their error events go out
                await asyncio.sleep(0.05)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains (Drain) before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            super().handle_exit(sig, frame)  # a second signal: stop now
            return
        self._loop.call_soon_threadsafe(self._start_draining)

    def _start_draining(self) -> None:
        async def drain_then_exit() -> None:
            await self.drain.run()
            self.should_exit = True

        self._draining = asyncio.ensure_future(drain_then_exit())
