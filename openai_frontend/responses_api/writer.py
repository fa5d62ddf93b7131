"""The frontend's one writer to the response store: what every run produced since the last commit goes in
one transaction (group commit), and each run hears when its events are durable.

Under more load a commit carries more events, so the store costs per token fall as streams are added; a
commit waits a few milliseconds at most for the rest of a burst (one engine step's outputs) to join it.
A commit that fails (the store unreachable) is retried with the next batch joined to it, in order, so a
run's events are stored in sequence or not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from openai_frontend.responses_api.store import ResponseStore, StatusChange, StoredEvent, StoreUnavailable

log = logging.getLogger("openai_frontend")

Committed = Callable[[set[str]], None]  # told the ids of status changes the store refused


@dataclass(frozen=True, slots=True)
class _Write:
    events: list[StoredEvent]
    change: StatusChange | None
    committed: Committed


class StoreWriter:
    RETRY_S = (0.05, 0.2, 1.0)
    GATHER_S = 0.004  # the longest a write waits for others to join its commit

    def __init__(self, store: ResponseStore, owner: str) -> None:
        self._store = store
        self._owner = owner  # events go in only for responses this frontend still holds
        self._pending: list[_Write] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.commits = 0  # transactions committed (the benchmark reads events per commit)
        self.events_written = 0

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="response-store-writer")

    def submit(self, events: list[StoredEvent], change: StatusChange | None, committed: Committed) -> None:
        self.start()  # (an app run without its lifespan, as in some tests, starts it here)
        self._pending.append(_Write(events, change, committed))
        self._wake.set()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Commit what is pending (for up to `timeout_s`), then stop."""
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._pending:
                    await asyncio.sleep(0.01)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _gather(self) -> None:
        """Let the rest of a burst arrive before committing: an engine step's outputs reach the frontend one
        gRPC message at a time, and one commit for all of them costs a fraction of one commit each. It looks
        every quarter of GATHER_S (not at every message: each look wakes this task) until none came."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.GATHER_S
        pending = -1
        while len(self._pending) != pending and loop.time() < deadline:
            pending = len(self._pending)
            await asyncio.sleep(self.GATHER_S / 4)

    async def _loop(self) -> None:
        failures = 0
        batch: list[_Write] = []
        while True:
            if not batch:
                await self._wake.wait()
                await self._gather()
            self._wake.clear()
            batch, self._pending = batch + self._pending, []
            events = [e for w in batch for e in w.events]
            changes = [w.change for w in batch if w.change is not None]
            try:
                refused = await self._store.commit(events, changes, owner=self._owner)
            except StoreUnavailable as e:
                delay = self.RETRY_S[min(failures, len(self.RETRY_S) - 1)]
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("response store: commit failed (%s), retrying; %d events wait", e, len(events))
                await asyncio.sleep(delay)
                continue
            except Exception:  # a bug must not stop every run's storage: its batch is dropped, loudly
                log.exception("response store: commit failed; %d events dropped", len(events))
                refused = {w.change.response_id for w in batch if w.change is not None}
            failures = 0
            self.commits += 1
            self.events_written += len(events)
            done, batch = batch, []
            for write in done:
                write.committed(refused)
