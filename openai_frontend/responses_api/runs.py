"""A Run: one response being generated in this process, from the engine's steps to its readers.

engine steps -> operations (text, call, arguments; ToolCallStream reads the calls, as chat does) ->
ResponseEvents -> (stored runs) the store writer -> the run's list of SSE frames -> any number of readers.
A stored run's event reaches its list only once the store has committed it (docs/responses.md), so what
any reader got is what a later owner continues from. Readers read the list at their own pace; none can
slow the run or another reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from openai_frontend.errors import FrontendError
from openai_frontend.generation import Usage
from openai_frontend.plans import ChatPlan
from openai_frontend.responses_api.events import Diverged, Event, ResponseEvents
from openai_frontend.responses_api.store import StatusChange, StoredEvent
from openai_frontend.responses_api.writer import StoreWriter
from openai_frontend.tool_calls import ToolCallStream
from protocol import StepOutput

log = logging.getLogger("openai_frontend")

EngineEvents = AsyncIterator[tuple[int, StepOutput]]


def sse_frame(event_type: str, data: str) -> str:
    return f"event: {event_type}\ndata: {data}\n\n"


def responses_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's Responses usage of a run; cached_tokens are the prompt tokens the prefix cache served."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class Run:
    def __init__(
        self,
        response_id: str,
        builder: ResponseEvents,
        plan: ChatPlan,
        engine_events: Callable[[], EngineEvents] | EngineEvents,
        usage: Callable[[], Usage],
        *,
        background: bool,
        writer: StoreWriter | None,
        owner: str,
        on_end: Callable[[Run], None],
    ) -> None:
        self.response_id = response_id
        self.builder = builder
        self.plan = plan
        self.background = background
        self._engine_events = engine_events  # a primed iterator, or a callable that starts the engine request
        self._usage = usage
        self._writer = writer  # None: store false, events go straight to the readers
        self._owner = owner
        self._on_end = on_end
        self.base = builder.next_sequence_number  # the sequence number of frames[0] (a taken-over run starts past 0)
        self.frames: list[str] = []
        self.done = False
        self.error: FrontendError | None = None  # why it failed (the non-streamed request raises it)
        self.cancelled = False
        self._abandoned = False
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._unsent = 0  # events handed to the writer, not yet committed
        self._drained = asyncio.Event()
        self._drained.set()
        self._ended = asyncio.Event()

    @property
    def stored(self) -> bool:
        return self._writer is not None

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, opening: list[Event]) -> None:
        """Emit `opening` (response.created, ...) and start generating."""
        self._emit(opening)
        self._task = asyncio.create_task(self._generate(), name=f"run-{self.response_id}")

    def stop(self) -> None:
        """Stop generating (cancelled, deleted or taken over elsewhere): the engine request is cancelled and
        nothing more is sent; the status stored is cancelled (unless the store has another word already)."""
        self.cancelled = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def abandon(self) -> None:
        """Stop generating and store nothing more: the response stays unfinished under its expiring lease, for
        another frontend (or this one restarted) to continue."""
        self._abandoned = True
        self.stop()

    async def wait(self) -> None:
        await self._ended.wait()

    # -- readers ------------------------------------------------------------------------------------

    async def frames_after(self, after: int) -> AsyncIterator[tuple[int, str]]:
        """(sequence_number, frame) of every delivered event after `after` (>= base - 1), then the live ones,
        until the run ends."""
        i = max(after + 1 - self.base, 0)
        while True:
            while i < len(self.frames):
                yield self.base + i, self.frames[i]
                i += 1
            if self.done:
                return
            changed = self._changed
            await changed.wait()

    # -- generation ---------------------------------------------------------------------------------

    async def _generate(self) -> None:
        status = "failed"
        try:
            engine = self._engine_events if not callable(self._engine_events) else self._engine_events()
            await self._produce(engine)
            status = self.builder.response["status"]
        except asyncio.CancelledError:
            status = "cancelled"
        except Diverged as e:
            log.error("response %s: its continuation diverged from what was sent: %s", self.response_id, e)
            self._emit(self.builder.fail("diverged", f"the continued generation differs from what was sent: {e}"))
        except FrontendError as e:
            self.error = e
            self._emit(self.builder.fail(e.code or e.error_type, e.message))
        except Exception as e:
            log.exception("response %s failed", self.response_id)
            self.error = FrontendError(f"internal error: {type(e).__name__}")
            self._emit(self.builder.fail("server_error", self.error.message))
        finally:
            await self._end(status)

    async def _produce(self, engine: EngineEvents) -> None:
        builder, plan = self.builder, self.plan
        calls = ToolCallStream(plan.tools) if plan.tools.active else None
        finish: str | None = None
        started = False
        async with aclosing(engine) as events:
            async for _, out in events:
                if not started:
                    started = True
                    self._emit(builder.in_progress())
                emitted: list[Event] = []
                if calls is None:
                    emitted += builder.text(out.text_delta)
                else:
                    deltas = calls.feed(out.text_delta) + (calls.finish() if out.finish_reason else [])
                    for delta in deltas:
                        emitted += _apply(builder, delta)
                if out.finish_reason is not None:
                    finish = out.finish_reason.value
                if emitted:
                    self._emit(emitted)
        if not started:
            self._emit(builder.in_progress())
        incomplete = "max_output_tokens" if finish == "length" else None
        self._emit(builder.finish(responses_usage(self._usage()), incomplete))

    async def _end(self, status: str) -> None:
        """Wait for the writer to commit what was emitted, then store the final status where no event did."""
        if status == "cancelled" and not self._abandoned:
            response = self.builder.response
            response["status"] = "cancelled"
            self._write([], response)
        with contextlib.suppress(asyncio.CancelledError):
            await self._drained.wait()
        self.done = True
        self._notify()
        self._ended.set()
        self._on_end(self)

    # -- emitting -----------------------------------------------------------------------------------

    def _emit(self, events: list[Event]) -> None:
        if not events:
            return
        if self.cancelled:
            return
        if self._writer is None:
            self._deliver(events)
            return
        terminal = self.builder.finished
        status_changed = terminal or any(e["type"] in ("response.created", "response.in_progress") for e in events)
        self._write(events, self.builder.response if status_changed else None)

    def _write(self, events: list[Event], response: dict[str, Any] | None) -> None:
        """Hand events (and the status change they make) to the writer; deliver them once committed."""
        if self._writer is None:
            return
        stored = [StoredEvent(self.response_id, e["sequence_number"], e["type"], json.dumps(e)) for e in events]
        change = None if response is None else StatusChange(self.response_id, response["status"], response, self._owner)
        self._unsent += 1
        self._drained.clear()

        def committed(refused: set[str]) -> None:
            if self.response_id in refused:  # cancelled, deleted or taken over meanwhile: nothing more goes out
                self.stop()
            else:
                self._deliver_stored(stored)
            self._unsent -= 1
            if not self._unsent:
                self._drained.set()

        self._writer.submit(stored, change, committed)

    def _deliver(self, events: list[Event]) -> None:
        self.frames.extend(sse_frame(e["type"], json.dumps(e)) for e in events)
        self._notify()

    def _deliver_stored(self, events: list[StoredEvent]) -> None:
        if events:
            self.frames.extend(sse_frame(e.type, e.data) for e in events)
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _apply(builder: ResponseEvents, delta: dict[str, Any]) -> list[Event]:
    """One chat delta of ToolCallStream (content, or a tool call's start or arguments) as operations."""
    if "content" in delta:
        return builder.text(delta["content"] or "")
    events: list[Event] = []
    for call in delta.get("tool_calls", ()):
        function = call.get("function", {})
        if "id" in call:
            events += builder.call(call["index"], function.get("name", ""), call["id"])
        if function.get("arguments"):
            events += builder.arguments(call["index"], function["arguments"])
    return events
