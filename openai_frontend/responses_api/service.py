"""The Responses API's service: create, retrieve, delete, cancel, list input items, and stream a stored
response from any point; the lease keeper and the sweeper that continues what a dead frontend began
(docs/responses.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from openai_frontend.chat_service import ChatService
from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import InvalidRequest, ResponseNotFound, StoreUnreachable
from openai_frontend.generation import Generation
from openai_frontend.metrics import Metrics
from openai_frontend.plans import ChatPlan
from openai_frontend.responses_api.conversation import chat_param, chat_request, listed_input_items, response_object
from openai_frontend.responses_api.events import ResponseEvents
from openai_frontend.responses_api.runs import EngineEvents, Run, sse_frame
from openai_frontend.responses_api.schemas import ResponsesRequest
from openai_frontend.responses_api.store import (
    TERMINAL,
    ResponseStore,
    StatusChange,
    StoredResponse,
    StoreUnavailable,
)
from openai_frontend.responses_api.writer import StoreWriter
from openai_frontend.settings import Settings
from openai_frontend.streams import generation, named_errors, primed

log = logging.getLogger("openai_frontend")

MAX_CONVERSATION_DEPTH = 1024  # previous_response_id links followed for one request
STOP_PASS_WAIT_S = 5.0  # how long a stop waits for the lease keeper's or sweeper's pass under way
_ORPHANED = "the frontend generating this response stopped before it finished"


class ResponsesService:
    def __init__(self, engine: EngineClient, settings: Settings, metrics: Metrics, chat: ChatService) -> None:
        self.engine, self.settings, self.metrics, self.chat = engine, settings, metrics, chat
        self.owner = f"frontend-{uuid.uuid4().hex[:16]}"
        self.store = ResponseStore.from_url(
            settings.response_store_url(), ttl_s=settings.response_ttl_s, max_responses=settings.response_store_max
        )
        self.writer = StoreWriter(self.store, self.owner)
        self._runs: dict[str, Run] = {}
        self._tasks: list[asyncio.Task] = []
        self._taking_over: set[str] = set()
        self._stopping = asyncio.Event()

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self.store.open()
            log.info("response store: %s", self.store.url_for_logs)
        except StoreUnavailable as e:  # the frontend serves all else; the store is retried when used
            log.warning("response store %s unreachable at start: %s", self.store.url_for_logs, e)
        self.writer.start()
        self._tasks = [
            asyncio.create_task(self._keep_leases(), name="response-leases"),
            asyncio.create_task(self._sweep(), name="response-sweeper"),
        ]

    async def stop(self) -> None:
        """Stop generating; what is unfinished stays owned by its expiring lease, so another frontend (or
        this one restarted) continues the background responses."""
        # The lease keeper and the sweeper end after the pass under way: a query cancelled mid-way can leave
        # its connection checked out, open and holding SQLite's lock past the store's close. Cancelled only
        # when a pass overruns (a store that stopped answering); awaited before the store closes, since a
        # pass whose connection is closed under it never ends.
        self._stopping.set()
        if self._tasks:
            _, overrunning = await asyncio.wait(self._tasks, timeout=STOP_PASS_WAIT_S)
            for task in overrunning:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.hand_over()
        for run in list(self._runs.values()):
            run.stop()
        await asyncio.gather(*(run.wait() for run in list(self._runs.values())), return_exceptions=True)
        await self.writer.stop()
        await self.store.close()

    def hand_over(self) -> None:
        """On shutdown: the background responses are left to their leases (another frontend, or this one
        restarted, continues them) rather than waited for or ended."""
        for run in list(self._runs.values()):
            if run.background and run.stored:
                run.abandon()

    # -- create -------------------------------------------------------------------------------------

    async def create(self, req: ResponsesRequest) -> Run:
        """Plan the request, store it (unless store is false), and start its run. Errors of the request
        itself raise here, before anything is stored; a foreground run's engine request is primed, so that
        the engine's refusals are HTTP errors too."""
        response_id = f"resp_{uuid.uuid4().hex}"
        created_at = int(time.time())
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        history = await self._history(req.previous_response_id) if req.previous_response_id else []
        plan = await self._plan(req, history, seed)
        status = "queued" if req.background else "in_progress"
        builder = ResponseEvents({**response_object(req, response_id, created_at, status), "model": plan.model})
        gen = generation(self.engine, self.metrics, plan)
        engine: EngineEvents | None = None
        if not req.background:
            engine = await primed(named_errors(gen.events(), plan))
        if req.store:
            record = StoredResponse(
                id=response_id,
                created_at=float(created_at),
                status=status,
                background=bool(req.background),
                owner=self.owner,
                lease_until=time.time() + self.settings.response_lease_s,
                previous_response_id=req.previous_response_id,
                request={**req.model_dump(mode="json", exclude_unset=True, by_alias=True), "seed": seed},
                input_items=listed_input_items(req),
                response=builder.response,
                last_sequence_number=-1,
            )
            try:
                await self._stored(self.store.create(record))
            except BaseException:
                if engine is not None:
                    await engine.aclose()  # type: ignore[attr-defined]
                raise
        run = self._run(
            response_id, builder, plan, gen, engine, background=bool(req.background), stored=bool(req.store)
        )
        run.start(builder.created())
        return run

    def _run(
        self,
        response_id: str,
        builder: ResponseEvents,
        plan: ChatPlan,
        gen: Generation,
        engine: EngineEvents | None,
        *,
        background: bool,
        stored: bool,
    ) -> Run:
        """A run of `plan` through `gen`: `engine` is its primed engine request (foreground), or None to start
        one when the run starts (background)."""
        if engine is None:

            def engine_events() -> EngineEvents:
                return named_errors(gen.events(), plan)

        run = Run(
            response_id,
            builder,
            plan,
            engine if engine is not None else engine_events,
            lambda: gen.usage,
            background=background,
            writer=self.writer if stored else None,
            owner=self.owner,
            on_end=self._ended,
        )
        self._runs[response_id] = run
        return run

    def _ended(self, run: Run) -> None:
        if self._runs.get(run.response_id) is run:
            del self._runs[run.response_id]

    async def _plan(self, req: ResponsesRequest, history: list[dict[str, Any]], seed: int) -> ChatPlan:
        try:
            return await self.chat.plan(chat_request(req, history, seed), force_usage=True)
        except InvalidRequest as e:
            e.param = chat_param(e.param)
            raise

    async def _history(self, previous_response_id: str) -> list[dict[str, Any]]:
        """The earlier turns of a conversation, oldest first: each response's input items, then its output."""
        chain: list[StoredResponse] = []
        next_id: str | None = previous_response_id
        while next_id is not None:
            if len(chain) >= MAX_CONVERSATION_DEPTH:
                raise InvalidRequest(
                    f"the conversation is longer than {MAX_CONVERSATION_DEPTH} responses", "previous_response_id"
                )
            row = await self._stored(self.store.get(next_id))
            if row is None:
                raise ResponseNotFound(next_id, "previous_response_id")
            chain.append(row)
            next_id = row.previous_response_id
        items: list[dict[str, Any]] = []
        for row in reversed(chain):
            items += row.input_items
            items += (await self._current(row))["output"]
        return items

    # -- stored responses ---------------------------------------------------------------------------

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        return await self._current(await self._row(response_id))

    async def delete(self, response_id: str) -> dict[str, Any]:
        if not await self._stored(self.store.delete(response_id)):
            raise ResponseNotFound(response_id)
        run = self._runs.get(response_id)
        if run is not None:
            run.stop()
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str) -> dict[str, Any]:
        row = await self._row(response_id)
        if not row.background:
            raise InvalidRequest("Only responses created with background=true can be cancelled.", "response_id")
        run = self._runs.get(response_id)

        def cancelled(response: dict[str, Any]) -> dict[str, Any]:
            now = run.builder.response if run is not None else response
            return {**now, "status": "cancelled"}

        after, did = await self._stored(self.store.cancel(response_id, cancelled))
        if after is None:
            raise ResponseNotFound(response_id)
        if not did:
            raise InvalidRequest(f"Cannot cancel a response with status {after.status}.", "response_id")
        if run is not None:
            run.stop()
            await run.wait()
        return after.response

    async def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        items = list((await self._row(response_id)).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise InvalidRequest(f"no input item with id '{after}' in this response", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    async def events(self, response_id: str, starting_after: int) -> AsyncIterator[str]:
        """The SSE frames of a stored response after `starting_after`: the stored ones, then the live ones
        until it finishes (from this process's run when it owns the response, else from the store)."""
        await self._row(response_id)  # 404 before the stream starts
        return self._follow(response_id, starting_after)

    async def _follow(self, response_id: str, after: int) -> AsyncIterator[str]:
        poll_s = self.settings.response_poll_ms / 1000
        while True:
            run = self._runs.get(response_id)
            if run is not None and after + 1 >= run.base:
                async with aclosing(run.frames_after(after)) as frames:
                    async for seq, frame in frames:
                        after = seq
                        yield frame
                if not run.cancelled or run.builder.finished:
                    return
                continue  # stopped here (taken over elsewhere?): the store has the rest
            stored = await self._stored(self.store.events_after(response_id, after))
            for event in stored:
                after = event.sequence_number
                yield sse_frame(event.type, event.data)
            if stored:
                continue
            row = await self._stored(self.store.get(response_id))
            if row is None or (row.status in TERMINAL and row.last_sequence_number <= after):
                return
            await asyncio.sleep(poll_s)

    async def _row(self, response_id: str) -> StoredResponse:
        row = await self._stored(self.store.get(response_id))
        if row is None:
            raise ResponseNotFound(response_id)
        return row

    async def _current(self, row: StoredResponse) -> dict[str, Any]:
        """The response object now: this process's run's when it generates it; for one another frontend is
        generating, what its stored events say so far; else the stored one."""
        run = self._runs.get(row.id)
        if run is not None and not run.done:
            return run.builder.response
        if row.status in TERMINAL or row.last_sequence_number < 0:
            return row.response
        events = await self._stored(self.store.events_after(row.id, -1, limit=row.last_sequence_number + 1))
        try:
            req = ResponsesRequest.model_validate(row.request)
            skeleton = {**response_object(req, row.id, int(row.created_at), "queued"), "model": row.response["model"]}
            return ResponseEvents.restore(skeleton, [json.loads(e.data) for e in events]).response
        except Exception:  # a row this version cannot read back: what was stored at its last status change
            log.exception("response %s: its events could not be read back", row.id)
            return row.response

    @staticmethod
    async def _stored(call: Any) -> Any:
        try:
            return await call
        except StoreUnavailable as e:
            raise StoreUnreachable(f"the response store is unreachable: {e}") from None

    # -- leases and takeover -------------------------------------------------------------------------

    async def _keep_leases(self) -> None:
        period = self.settings.response_lease_s / 3
        while not await self._stopping_within(period):
            with contextlib.suppress(StoreUnavailable):
                running = dict(self._runs)  # (a run created while the renewal is under way is not judged by it)
                held = await self.store.renew(self.owner, time.time() + self.settings.response_lease_s)
                for response_id, run in running.items():
                    if run.stored and not run.done and response_id not in held:
                        log.info("response %s: no longer ours (cancelled, deleted or taken over)", response_id)
                        run.stop()

    async def _sweep(self) -> None:
        period = self.settings.response_lease_s / 2
        last_expiry = 0.0
        while not self._stopping.is_set():
            try:
                now = time.time()
                for response_id in await self.store.fail_orphans(now, _failed_orphan):
                    log.warning("response %s: its frontend stopped; marked failed", response_id)
                claimed = await self.store.claim_orphans(self.owner, now, now + self.settings.response_lease_s)
                for row in claimed:
                    await self._take_over(row)
                if now - last_expiry > 60:
                    last_expiry = now
                    deleted = await self.store.expire(now)
                    if deleted:
                        log.info("response store: %d responses past retention deleted", deleted)
            except StoreUnavailable as e:
                log.debug("response sweep: store unreachable: %s", e)
            except Exception:
                log.exception("response sweep failed")
            await self._stopping_within(period)

    async def _stopping_within(self, seconds: float) -> bool:
        """Waits `seconds`, or less if the service stops meanwhile; whether it is stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    async def _take_over(self, row: StoredResponse) -> None:
        """Continue a background response whose frontend died: generate it again from the start (the same
        seed, the same tokens) and send only what goes past its stored events."""
        log.warning("response %s: its frontend stopped; this one continues it", row.id)
        try:
            req = ResponsesRequest.model_validate(row.request)
            history = await self._history(req.previous_response_id) if req.previous_response_id else []
            plan = await self._plan(req, history, row.request["seed"])
            stored = await self.store.events_after(row.id, -1, limit=10**9)
            skeleton = {**response_object(req, row.id, int(row.created_at), "queued"), "model": plan.model}
            builder = ResponseEvents.restore(skeleton, [json.loads(e.data) for e in stored])
        except Exception as e:
            log.exception("response %s: cannot be continued", row.id)
            failed = {**row.response, "status": "failed", "error": _error(f"the response could not be continued: {e}")}
            with contextlib.suppress(StoreUnavailable):
                await self.store.commit([], [StatusChange(row.id, "failed", failed, self.owner)])
            return
        gen = generation(self.engine, self.metrics, plan)
        run = self._run(row.id, builder, plan, gen, None, background=True, stored=True)
        run.start(builder.created() + builder.in_progress())


def _error(message: str) -> dict[str, str]:
    return {"code": "server_error", "message": message}


def _failed_orphan(response: dict[str, Any]) -> dict[str, Any]:
    return {**response, "status": "failed", "error": _error(_ORPHANED)}
