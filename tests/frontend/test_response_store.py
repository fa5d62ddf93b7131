"""The response store on both of its databases: a SQLite file, and a real PostgreSQL server (one per session, a new
database per test). Concurrency is tested with several stores on one database, as several frontends use it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from openai_frontend.responses_api.store import (
    MIGRATIONS,
    ResponseStore,
    StatusChange,
    StoredEvent,
    StoredResponse,
    StoreUnavailable,
    responses,
    schema_version,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A new, empty database."""
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/store/responses.db"  # (a folder that open() makes)
    return request.getfixturevalue("postgresql").create_database(f"test_{uuid.uuid4().hex[:16]}")


@contextlib.asynccontextmanager
async def opened(url: str, **kwargs: Any) -> AsyncIterator[ResponseStore]:
    store = ResponseStore.from_url(url, **kwargs)
    try:
        await store.open()
        yield store
    finally:
        await store.close()


@pytest.fixture
async def store(url: str) -> AsyncIterator[ResponseStore]:
    async with opened(url) as s:
        yield s


def record(
    response_id: str,
    *,
    status: str = "in_progress",
    owner: str | None = "frontend-a",
    lease_until: float | None = None,
    background: bool = False,
    created_at: float | None = None,
) -> StoredResponse:
    now = time.time()
    return StoredResponse(
        id=response_id,
        created_at=now if created_at is None else created_at,
        status=status,
        background=background,
        owner=owner,
        lease_until=(now + 30 if owner is not None else None) if lease_until is None else lease_until,
        previous_response_id=None,
        request={"model": "m", "input": "Grüß dich ☃", "seed": 7},
        input_items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Grüß dich ☃"}]}],
        response={"id": response_id, "object": "response", "status": status, "output": []},
        last_sequence_number=-1,
    )


def events(response_id: str, numbers: range) -> list[StoredEvent]:
    return [
        StoredEvent(response_id, n, "response.output_text.delta", f'{{"sequence_number":{n},"delta":"\\u00e9{n}"}}')
        for n in numbers
    ]


def change(response_id: str, status: str, owner: str = "frontend-a") -> StatusChange:
    return StatusChange(response_id, status, {"id": response_id, "status": status, "output": ["done"]}, owner)


def marked(status: str, note: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda old: {**old, "status": status, "note": note}


async def test_create_get_delete(store: ResponseStore) -> None:
    r = record("resp_1", background=True)
    await store.create(r)
    assert await store.get("resp_1") == r
    assert await store.get("resp_absent") is None
    assert await store.commit(events("resp_1", range(3)), []) == set()
    assert await store.delete("resp_1")
    assert await store.get("resp_1") is None
    assert await store.events_after("resp_1", -1) == []
    assert not await store.delete("resp_1")


async def test_a_response_past_its_ttl_is_absent(url: str) -> None:
    async with opened(url, ttl_s=60) as store:
        await store.create(record("resp_old", created_at=time.time() - 120))
        assert await store.get("resp_old") is None
        assert await store.cancel("resp_old", marked("cancelled", "")) == (None, False)
        assert not await store.delete("resp_old")


async def test_events_after_ascends_and_pages(store: ResponseStore) -> None:
    await store.create(record("resp_1"))
    await store.create(record("resp_2"))
    assert await store.commit(events("resp_1", range(5)) + events("resp_2", range(2)), [], owner="frontend-a") == set()
    assert await store.commit(events("resp_1", range(5, 10)), []) == set()
    assert (await store.get("resp_1")).last_sequence_number == 9
    assert (await store.get("resp_2")).last_sequence_number == 1
    pages = [await store.events_after("resp_1", after, limit=4) for after in (-1, 3, 7, 9)]
    assert [[e.sequence_number for e in page] for page in pages] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []]
    assert pages[0][1] == events("resp_1", range(1, 2))[0]  # (the text exactly as given)


async def test_commit_refuses_what_was_cancelled_taken_over_or_deleted(store: ResponseStore) -> None:
    for response_id in ("resp_ok", "resp_cancelled", "resp_deleted"):
        await store.create(record(response_id))
    await store.create(record("resp_taken", owner="frontend-b"))
    await store.cancel("resp_cancelled", marked("cancelled", "by the client"))
    await store.delete("resp_deleted")
    ids = ("resp_ok", "resp_cancelled", "resp_taken", "resp_deleted")
    batch = [e for i in ids for e in events(i, range(2))]
    refused = await store.commit(batch, [change(i, "completed") for i in ids], owner="frontend-a")
    assert refused == {"resp_cancelled", "resp_taken", "resp_deleted"}

    ok = await store.get("resp_ok")
    assert (ok.status, ok.owner, ok.lease_until, ok.response["output"]) == ("completed", None, None, ["done"])
    assert len(await store.events_after("resp_ok", -1)) == 2
    cancelled = await store.get("resp_cancelled")
    assert (cancelled.status, cancelled.response["note"]) == ("cancelled", "by the client")
    assert await store.events_after("resp_cancelled", -1) == []
    taken = await store.get("resp_taken")
    assert (taken.status, taken.owner) == ("in_progress", "frontend-b")
    assert await store.events_after("resp_taken", -1) == []
    assert await store.events_after("resp_deleted", -1) == []


async def test_commit_without_an_owner_stores_events_of_any_unfinished_response(store: ResponseStore) -> None:
    await store.create(record("resp_taken", owner="frontend-b"))
    assert await store.commit(events("resp_taken", range(2)), [change("resp_taken", "completed")]) == {"resp_taken"}
    assert len(await store.events_after("resp_taken", -1)) == 2


async def test_commit_applies_changes_in_order(store: ResponseStore) -> None:
    await store.create(record("resp_1", status="queued", background=True))
    changes = [change("resp_1", "in_progress"), change("resp_1", "completed"), change("resp_1", "failed")]
    assert await store.commit([], changes) == {"resp_1"}  # (nothing follows a terminal status)
    assert (await store.get("resp_1")).status == "completed"


async def test_commit_retried_after_it_committed_changes_nothing(store: ResponseStore) -> None:
    await store.create(record("resp_1"))
    batch, changes = events("resp_1", range(3)), [change("resp_1", "completed")]
    assert await store.commit(batch, changes, owner="frontend-a") == set()
    before = await store.get("resp_1")
    assert await store.commit(batch, changes, owner="frontend-a") == set()
    assert await store.get("resp_1") == before
    assert len(await store.events_after("resp_1", -1)) == 3


async def test_commit_applies_only_the_changes_of_the_rows_holder(store: ResponseStore) -> None:
    await store.create(record("resp_1"))
    await store.create(record("resp_2"))
    mixed = [change("resp_1", "in_progress"), change("resp_1", "failed", owner="frontend-b")]
    mixed += [change("resp_1", "completed"), change("resp_2", "completed", owner="frontend-b")]
    assert await store.commit([], mixed) == {"resp_2"}
    assert (await store.get("resp_1")).status == "completed"
    assert (await store.get("resp_2")).status == "in_progress"


async def test_an_owner_whose_lease_was_taken_over_writes_nothing(url: str, store: ResponseStore) -> None:
    now = time.time()
    await store.create(record("resp_1", background=True, lease_until=now - 1))
    assert await store.commit(events("resp_1", range(3)), [], owner="frontend-a") == set()
    async with opened(url) as other:
        (claimed,) = await other.claim_orphans("frontend-b", now, now + 30)
    assert (claimed.owner, claimed.last_sequence_number) == ("frontend-b", 2)
    late = events("resp_1", range(3, 5))
    assert await store.commit(late, [], owner="frontend-a") == {"resp_1"}
    assert await store.commit(late, [change("resp_1", "completed")], owner="frontend-a") == {"resp_1"}
    row = await store.get("resp_1")
    assert (row.status, row.owner, row.last_sequence_number) == ("in_progress", "frontend-b", 2)
    assert [e.sequence_number for e in await store.events_after("resp_1", -1)] == [0, 1, 2]


async def test_a_commit_waiting_on_a_takeover_sees_it(url: str, store: ResponseStore) -> None:
    """The commit reads the owner once it holds the row (PostgreSQL: its row lock; SQLite: the write lock), not
    before: a takeover that commits while the commit waits refuses it."""
    await store.create(record("resp_1"))
    async with opened(url) as other:
        async with other._writes.begin() as conn:  # (a takeover, its transaction held open)
            taken = sa.update(responses).where(responses.c.id == "resp_1").values(owner="frontend-b")
            await conn.execute(taken)
            commit = asyncio.create_task(store.commit(events("resp_1", range(2)), [], owner="frontend-a"))
            await asyncio.sleep(0.3)
            assert not commit.done()
        assert await commit == {"resp_1"}
    assert await store.events_after("resp_1", -1) == []


async def test_a_commit_is_one_round_trip(kind: str, store: ResponseStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Of any size: SQLite's wakes the event loop once (its whole transaction is one call on the store's thread;
    aiosqlite would wake it at each statement), PostgreSQL's is one statement on the store's connection."""
    ids = [f"resp_{i}" for i in range(8)]
    for response_id in ids:
        await store.create(record(response_id, status="queued"))
    await store.commit(events("resp_0", range(1)), [], owner="frontend-a")  # (the commits' connection opens)
    calls: list[Any] = []
    if kind == "sqlite":
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a, **k: (calls.append(a), wake(*a, **k))[1])
    else:
        store._commit_conn[1].add_query_logger(calls.append)
    batch = [e for i in ids for e in events(i, range(1, 17))]
    changes = [change(i, "in_progress") for i in ids] + [change("resp_7", "completed")]
    assert await store.commit(batch, changes, owner="frontend-a") == set()
    monkeypatch.undo()
    await asyncio.sleep(0)  # (asyncpg calls its query loggers soon after, not at once)
    assert len(calls) == 1
    assert (await store.get("resp_7")).status == "completed"
    assert [(await store.get(i)).last_sequence_number for i in ids] == [16] * len(ids)


async def test_cancel_is_a_compare_and_set(store: ResponseStore) -> None:
    await store.create(record("resp_1", background=True))
    after, did = await store.cancel("resp_1", marked("cancelled", "first"))
    assert did
    assert (after.status, after.owner, after.lease_until, after.response["note"]) == ("cancelled", None, None, "first")
    assert await store.get("resp_1") == after
    assert await store.cancel("resp_1", marked("cancelled", "second")) == (after, False)
    assert await store.cancel("resp_absent", marked("cancelled", "")) == (None, False)

    await store.create(record("resp_done"))
    await store.commit([], [change("resp_done", "completed")])
    done, did = await store.cancel("resp_done", marked("cancelled", ""))
    assert (done.status, did) == ("completed", False)


async def test_renew_extends_the_owners_unfinished_leases(store: ResponseStore) -> None:
    await store.create(record("resp_a1"))
    await store.create(record("resp_a2", status="queued", background=True))
    await store.create(record("resp_done"))
    await store.create(record("resp_b", owner="frontend-b", lease_until=123.0))
    await store.commit([], [change("resp_done", "completed")])
    lease = time.time() + 300
    assert await store.renew("frontend-a", lease) == {"resp_a1", "resp_a2"}
    assert (await store.get("resp_a1")).lease_until == lease
    assert (await store.get("resp_done")).lease_until is None
    assert (await store.get("resp_b")).lease_until == 123.0
    assert await store.renew("frontend-gone", lease) == set()


async def test_two_sweepers_claim_each_orphan_once(
    kind: str, url: str, store: ResponseStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL both sweepers read the same orphans before either claims one, so that the compare-and-set
    decides; SQLite's write lock keeps the second sweeper's read until the first has committed."""
    now = time.time()
    orphans = {f"resp_orphan_{i}" for i in range(12)}
    for response_id in sorted(orphans):
        await store.create(record(response_id, background=True, owner="frontend-dead", lease_until=now - 10))
    await store.create(record("resp_foreground", owner="frontend-dead", lease_until=now - 10))
    await store.create(record("resp_alive", background=True, owner="frontend-b", lease_until=now + 30))
    await store.create(record("resp_finished", status="completed", background=True, owner=None))

    async with opened(url) as other:
        if kind == "postgresql":
            both_read = asyncio.Barrier(2)
            for sweeper in (store, other):
                monkeypatch.setattr(sweeper, "_orphans", _then_waiting(sweeper._orphans, both_read))
        mine, theirs = await asyncio.gather(
            store.claim_orphans("frontend-a", now, now + 30, limit=16),
            other.claim_orphans("frontend-c", now, now + 30, limit=16),
        )
    monkeypatch.undo()
    assert {r.id for r in mine}.isdisjoint(r.id for r in theirs)
    assert {r.id for r in mine} | {r.id for r in theirs} == orphans
    for claimer, claimed in (("frontend-a", mine), ("frontend-c", theirs)):
        for r in claimed:
            assert (r.owner, r.lease_until) == (claimer, now + 30)
            assert await store.get(r.id) == r
    assert await store.claim_orphans("frontend-a", now, now + 30) == []


def _then_waiting(read: Callable[..., Any], barrier: asyncio.Barrier) -> Callable[..., Any]:
    async def read_then_wait(*args: Any, **kwargs: Any) -> Any:
        rows = await read(*args, **kwargs)
        await barrier.wait()
        return rows

    return read_then_wait


async def test_claim_orphans_takes_the_longest_expired_first(store: ResponseStore) -> None:
    now = time.time()
    for i in range(4):
        await store.create(record(f"resp_{i}", background=True, owner="frontend-dead", lease_until=now - 10 + i))
    assert [r.id for r in await store.claim_orphans("frontend-a", now, now + 30, limit=2)] == ["resp_0", "resp_1"]


async def test_fail_orphans_fails_foreground_responses_whose_frontend_died(store: ResponseStore) -> None:
    now = time.time()
    await store.create(record("resp_orphan", owner="frontend-dead", lease_until=now - 10))
    await store.create(record("resp_background", background=True, owner="frontend-dead", lease_until=now - 10))
    await store.create(record("resp_alive", owner="frontend-b", lease_until=now + 30))
    assert await store.fail_orphans(now, marked("failed", "orphaned")) == ["resp_orphan"]
    failed = await store.get("resp_orphan")
    assert (failed.status, failed.owner, failed.lease_until, failed.response["note"]) == (
        "failed",
        None,
        None,
        "orphaned",
    )
    assert (await store.get("resp_background")).status == "in_progress"
    assert (await store.get("resp_alive")).status == "in_progress"
    assert await store.fail_orphans(now, marked("failed", "again")) == []


async def test_expire_by_ttl_then_the_oldest_finished_past_the_cap(url: str) -> None:
    now = time.time()
    async with opened(url, ttl_s=100, max_responses=3) as store:
        await store.create(record("resp_old_running", created_at=now - 200))
        await store.create(record("resp_old_done", status="completed", owner=None, created_at=now - 150))
        for i in range(4):
            await store.create(record(f"resp_done_{i}", status="completed", owner=None, created_at=now - 50 + i))
        await store.create(record("resp_running", created_at=now - 60))
        await store.commit(events("resp_old_running", range(2)) + events("resp_done_0", range(2)), [])
        assert await store.expire(now) == 4
        for gone in ("resp_old_running", "resp_old_done", "resp_done_0", "resp_done_1"):
            assert await store.get(gone) is None
            assert await store.events_after(gone, -1) == []
        for kept in ("resp_running", "resp_done_2", "resp_done_3"):
            assert await store.get(kept) is not None
        assert await store.expire(now) == 0

    async with opened(url, max_responses=0) as store:  # (an unfinished response is never deleted for the cap)
        assert await store.expire(now) == 2
        assert await store.get("resp_running") is not None


async def test_migrations_are_idempotent_and_safe_at_once(url: str) -> None:
    stores = [ResponseStore.from_url(url) for _ in range(3)]
    try:
        await asyncio.gather(*(s.open() for s in stores))
        await stores[0].open()
        async with opened(url) as again:
            await again.create(record("resp_1"))
            assert await stores[2].get("resp_1") is not None
            async with again._engine.connect() as conn:  # (the version table, read directly)
                assert (await conn.execute(sa.select(schema_version.c.version))).scalars().all() == [len(MIGRATIONS)]
    finally:
        for s in stores:
            await s.close()


async def test_unreachable_store_then_reachable(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A store whose database is down fails fast, and the next call after it comes up opens it."""
    with contextlib.ExitStack() as stack:
        if kind == "sqlite":
            blocker = tmp_path / "blocker"
            blocker.write_text("a file where the database's folder goes")
            url, come_up = f"sqlite:///{blocker}/responses.db", blocker.unlink
        else:
            server = request.getfixturevalue("postgresql")
            target = f"test_{uuid.uuid4().hex[:16]}"
            server.create_database(target)
            closed = stack.enter_context(socket.socket())
            closed.bind(("127.0.0.1", 0))  # (bound, not listening: a connection to it is refused)
            url = f"postgresql://postgres:secret@127.0.0.1:{closed.getsockname()[1]}/{target}"
            come_up = None
        store = ResponseStore.from_url(url)
        try:
            started = time.perf_counter()
            with pytest.raises(StoreUnavailable):
                await store.open()
            with pytest.raises(StoreUnavailable):
                await store.get("resp_1")
            assert time.perf_counter() - started < 5
            if come_up is not None:
                come_up()
            else:
                proxy = await asyncio.start_server(_forwarding_to(server.port), sock=closed)
                stack.callback(proxy.close)
            assert await store.get("resp_1") is None
            await store.create(record("resp_1"))
            assert (await store.get("resp_1")).id == "resp_1"
        finally:
            await store.close()


def _forwarding_to(port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any]:
    """A TCP proxy's connection handler: what comes in goes to 127.0.0.1:port, and back."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)

    return handle


def test_urls() -> None:
    cases = {
        "sqlite:////var/lib/r.db": "sqlite+aiosqlite:////var/lib/r.db",
        "/var/lib/r.db": "sqlite+aiosqlite:////var/lib/r.db",
        "postgres://u:pw@db:5433/r": "postgresql+asyncpg://u:***@db:5433/r",
        "postgresql://u:pw@db/r": "postgresql+asyncpg://u:***@db/r",
    }
    for url, shown in cases.items():
        assert ResponseStore.from_url(url).url_for_logs == shown
    for bad in ("sqlite://", "sqlite:///:memory:", "mysql://u@db/r"):
        with pytest.raises(ValueError):
            ResponseStore.from_url(bad)
