"""The response store: responses, their stream events and their leases, in SQLite or PostgreSQL.

One SQLAlchemy Core schema serves both databases (sqlite+aiosqlite, postgresql+asyncpg); JSON is kept as text. Every
read-then-write is a compare-and-set inside one transaction. On PostgreSQL the rows it decides on are locked first
(SELECT ... FOR UPDATE), always in id order, so that two transactions never wait on each other in a cycle. On SQLite a
writing transaction begins IMMEDIATE: it takes the database's one write lock before it reads, so what it read still
holds when it writes (a deferred one would fail, whatever the busy timeout, once another connection wrote meanwhile).
A read is one statement, run without BEGIN and COMMIT on both databases (their round trips would double its cost).

The owner's commits (events and status changes, many a second) bypass SQLAlchemy: each is one round trip. On
PostgreSQL it is one statement on a connection the store holds for them (lock the rows, insert the events that their
owner may write, apply the changes, return what it locked); on SQLite the whole transaction is one call on a thread
that owns its own sqlite3 connection, so the event loop wakes once per commit (aiosqlite wakes it at every statement).
A response's last sequence number is read from its events (max), so a commit writes no more than the events.

A finished response has neither owner nor lease, so a lookup by owner (renew) or by lease (the sweeps) reaches only
unfinished ones through its index, however many finished ones are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import asyncpg
import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

TERMINAL = frozenset({"completed", "incomplete", "cancelled", "failed"})
CONNECT_TIMEOUT_S = 5.0  # an unreachable PostgreSQL answers a request (with 503) within this
COMMAND_TIMEOUT_S = 30.0  # a statement on a connection whose peer vanished fails instead of waiting forever
SQLITE_BUSY_TIMEOUT_S = 5.0  # how long a writer waits for another process's write lock on the same file
MIGRATION_LOCK = 0x7265_7370_6F6E_7365  # pg_advisory_xact_lock key ("response"): one migrating frontend at a time
DELETE_CHUNK = 500  # responses deleted per transaction by `expire`, so the write lock is never held long

_SORTED_TERMINAL = sorted(TERMINAL)  # (a stable statement text, so the statement caches hit)


class StoreUnavailable(Exception):
    """The database cannot be reached or answered with an error that is not the caller's (-> HTTP 503)."""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    id: str
    created_at: float  # unix seconds
    status: str  # queued | in_progress | completed | incomplete | cancelled | failed
    background: bool
    owner: str | None  # the instance id of the frontend generating it (None once finished)
    lease_until: float | None
    previous_response_id: str | None
    request: dict[str, Any]  # the request body as JSON (the service resolved the seed into it)
    input_items: list[dict[str, Any]]  # this response's input items, as listed by the API
    response: dict[str, Any]  # the response object (OpenAI's shape), as of its last status change
    last_sequence_number: int  # of its stored events; -1 when none


class StoredEvent(NamedTuple):
    """One stream event. A tuple: a commit's list of them is the drivers' rows as it is (no copy per event)."""

    response_id: str
    sequence_number: int
    type: str  # e.g. "response.output_text.delta"
    data: str  # the event's JSON text, exactly as sent


@dataclass(frozen=True, slots=True)
class StatusChange:
    response_id: str
    status: str
    response: dict[str, Any]  # the new response object snapshot
    owner: str  # applied only while the row's owner is this owner and its status is not terminal


metadata = sa.MetaData()

responses = sa.Table(
    "responses",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("background", sa.Boolean, nullable=False),
    sa.Column("owner", sa.Text),
    sa.Column("lease_until", sa.Double),
    sa.Column("previous_response_id", sa.Text),
    sa.Column("request", sa.Text, nullable=False),
    sa.Column("input_items", sa.Text, nullable=False),
    sa.Column("response", sa.Text, nullable=False),
    # (-1 at create and not kept up: StoredResponse.last_sequence_number is read from the events)
    sa.Column("last_sequence_number", sa.Integer, nullable=False),
    sa.Index("responses_lease_until", "lease_until"),
    sa.Index("responses_owner", "owner"),
    sa.Index("responses_created_at", "created_at"),
)

response_events = sa.Table(
    "response_events",
    metadata,
    sa.Column("response_id", sa.Text, primary_key=True),
    sa.Column("sequence_number", sa.Integer, primary_key=True),
    sa.Column("type", sa.Text, nullable=False),
    sa.Column("data", sa.Text, nullable=False),
)

schema_version = sa.Table("response_store_schema", metadata, sa.Column("version", sa.Integer, nullable=False))


def _create_tables(conn: sa.Connection) -> None:
    metadata.create_all(conn, tables=[responses, response_events])


# Step n takes a database from version n - 1 to n. Step 1 is create_all of the Table objects above while they are the
# version-1 schema; a change to them comes with a step of its own that alters existing databases. A database that a
# newer frontend migrated further is left as it is.
MIGRATIONS: list[Callable[[sa.Connection], None]] = [_create_tables]

_unfinished = responses.c.status.not_in(_SORTED_TERMINAL)
# (not the caller's fault, so not a 503: a bug of ours or of the caller, raised as it is; the drivers' own classes
# come from the commits, which call the drivers directly)
_CALLER_ERRORS = (
    exc.IntegrityError, exc.ProgrammingError, exc.DataError, exc.NotSupportedError,
    sqlite3.IntegrityError, sqlite3.ProgrammingError, sqlite3.DataError, sqlite3.NotSupportedError,
    asyncpg.IntegrityConstraintViolationError, asyncpg.DataError, asyncpg.SyntaxOrAccessError,
    asyncpg.FeatureNotSupportedError,
)  # fmt: skip
# (TimeoutError is asyncio's too; OSError is how a refused or unresolvable connection surfaces)
_UNAVAILABLE_ERRORS = (
    exc.DBAPIError, exc.TimeoutError, OSError, TimeoutError, sqlite3.Error, asyncpg.PostgresError,
    asyncpg.InterfaceError,
)  # fmt: skip
_e = response_events.c
# A response's last sequence number, -1 before its first event (one step down the events' primary key).
_last_sequence_number = (
    sa.select(sa.func.coalesce(sa.func.max(_e.sequence_number), -1))
    .where(_e.response_id == responses.c.id)
    .correlate(responses)
    .scalar_subquery()
    .label("last_sequence_number")
)
# (every column of a response as StoredResponse reads it)
_RESPONSE = [c for c in responses.c if c.name != "last_sequence_number"] + [_last_sequence_number]
_BEGIN = "response_store_begin"  # the execution option that says how a SQLite transaction begins (reads: none)


class ResponseStore:
    def __init__(self, url: URL, *, ttl_s: float, max_responses: int) -> None:
        self.ttl_s, self.max_responses = ttl_s, max_responses
        self._url = url
        self._sqlite = url.get_backend_name() == "sqlite"
        if self._sqlite:
            connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S}
            engine = create_async_engine(url, pool_size=4, max_overflow=4, connect_args=connect_args)
            sa.event.listen(engine.sync_engine, "connect", _sqlite_connected)
            sa.event.listen(engine.sync_engine, "begin", _sqlite_begin)
            self._writes, self._reads = engine.execution_options(**{_BEGIN: "BEGIN IMMEDIATE"}), engine
        else:
            connect_args = {"timeout": CONNECT_TIMEOUT_S, "command_timeout": COMMAND_TIMEOUT_S}
            engine = create_async_engine(url, pool_timeout=CONNECT_TIMEOUT_S, connect_args=connect_args)
            self._writes, self._reads = engine, engine.execution_options(isolation_level="AUTOCOMMIT")
        self._engine: AsyncEngine = engine
        self._opened = False
        self._commit_lock = asyncio.Lock()  # (one commit at a time on the commits' connection)
        self._commit_conn: tuple[AsyncConnection, asyncpg.Connection] | None = None  # PostgreSQL's, when open
        self._sqlite_thread = _SqliteThread(self._url.database or "") if self._sqlite else None
        self._open_lock = asyncio.Lock()
        self._open_attempts = 0
        self._open_failure: StoreUnavailable | None = None

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float = 30 * 86400, max_responses: int = 100_000) -> ResponseStore:
        """`sqlite:///path/to/file.db` (or a bare filesystem path) -> sqlite+aiosqlite; `postgresql://...` or
        `postgres://...` -> postgresql+asyncpg. Creates no connection yet."""
        return cls(_driver_url(url), ttl_s=ttl_s, max_responses=max_responses)

    @property
    def url_for_logs(self) -> str:
        return self._url.render_as_string(hide_password=True)

    # -- lifecycle ----------------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and migrate (idempotent; several frontends may open one database at once). Any later call
        opens the store when this failed, so a frontend starts while its database is down."""
        await self._open(retry=True)

    async def close(self) -> None:
        if self._sqlite_thread is not None:
            await self._sqlite_thread.close()
        if self._commit_conn is not None:
            conn, self._commit_conn = self._commit_conn[0], None
            with contextlib.suppress(*_UNAVAILABLE_ERRORS):
                await conn.close()
        await self._engine.dispose()

    async def _open(self, *, retry: bool) -> None:
        if self._opened:
            return
        attempts = self._open_attempts
        async with self._open_lock:
            if self._opened:
                return
            if not retry and self._open_attempts != attempts and self._open_failure is not None:
                # (an attempt failed while this call waited for it: its callers answer now, not one after another)
                raise StoreUnavailable(str(self._open_failure)) from self._open_failure.__cause__
            self._open_attempts += 1
            try:
                async with self._errors_mapped():
                    await self._migrate()
            except StoreUnavailable as e:
                self._open_failure = e
                raise
            self._opened, self._open_failure = True, None

    async def _migrate(self) -> None:
        if self._sqlite:
            Path(self._url.database or "").parent.mkdir(parents=True, exist_ok=True)
        async with self._writes.begin() as conn:
            if not self._sqlite:
                await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.literal(MIGRATION_LOCK, sa.BigInteger))))
            await conn.run_sync(schema_version.create, checkfirst=True)
            version = (await conn.execute(sa.select(schema_version.c.version))).scalar()
            if version is None:
                await conn.execute(schema_version.insert().values(version=0))
                version = 0
            for step in MIGRATIONS[version:]:
                await conn.run_sync(step)
            if version < len(MIGRATIONS):
                await conn.execute(schema_version.update().values(version=len(MIGRATIONS)))

    @contextlib.asynccontextmanager
    async def _errors_mapped(self) -> AsyncIterator[None]:
        try:
            yield
        except _CALLER_ERRORS:
            raise
        except _UNAVAILABLE_ERRORS as e:
            cause = e.orig if isinstance(e, exc.DBAPIError) and e.orig is not None else e
            raise StoreUnavailable(f"{type(cause).__name__}: {cause}".rstrip(": ")) from e

    @contextlib.asynccontextmanager
    async def _transaction(self, *, write: bool = False) -> AsyncIterator[AsyncConnection]:
        await self._open(retry=False)
        async with self._errors_mapped(), (self._writes if write else self._reads).begin() as conn:
            yield conn

    def _live(self, created_at: float, now: float) -> bool:
        return created_at >= now - self.ttl_s

    # -- one response -------------------------------------------------------------------------------

    async def create(self, r: StoredResponse) -> None:
        """One statement, one round trip, as a commit is (on a pooled connection: creates run side by side)."""
        values = _values(r)
        await self._open(retry=False)
        async with self._errors_mapped():
            if self._sqlite_thread is not None:
                await self._sqlite_thread.call(sqlite3.Connection.execute, _INSERT_RESPONSE, values)
                return
            async with self._writes.connect() as conn:
                try:
                    await (await conn.get_raw_connection()).driver_connection.execute(_INSERT_RESPONSE_PG, *values)
                except BaseException:  # (its state unknown, this connection is not used again)
                    with contextlib.suppress(*_UNAVAILABLE_ERRORS):
                        await conn.invalidate()
                    raise

    async def get(self, response_id: str) -> StoredResponse | None:
        """None if absent or past its TTL."""
        async with self._transaction() as conn:
            row = (await conn.execute(sa.select(*_RESPONSE).where(responses.c.id == response_id))).first()
        return _stored(row) if row is not None and self._live(row.created_at, time.time()) else None

    async def delete(self, response_id: str) -> bool:
        """Delete it and its events; False if it was absent (or past its TTL, as `get` has it)."""
        async with self._transaction(write=True) as conn:
            deleted = await self._delete(conn, [response_id])
            created_at = deleted.get(response_id)
        return created_at is not None and self._live(created_at, time.time())

    async def events_after(self, response_id: str, after: int, limit: int = 1000) -> list[StoredEvent]:
        """Its stored events numbered above `after`, ascending, at most `limit`."""
        e = response_events.c
        query = (
            sa.select(e.response_id, e.sequence_number, e.type, e.data)
            .where(e.response_id == response_id, e.sequence_number > after)
            .order_by(e.sequence_number)
            .limit(limit)
        )
        async with self._transaction() as conn:
            rows = (await conn.execute(query)).all()
        return [StoredEvent(*row) for row in rows]

    async def cancel(
        self, response_id: str, response: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> tuple[StoredResponse | None, bool]:
        """Compare-and-set: if not terminal, status -> cancelled, response JSON -> response(old response JSON),
        owner/lease cleared. Returns (row after, whether this call cancelled it); (None, False) if absent."""
        async with self._transaction(write=True) as conn:
            query = sa.select(*_RESPONSE).where(responses.c.id == response_id).with_for_update(of=responses)
            row = (await conn.execute(query)).first()
            if row is None or not self._live(row.created_at, time.time()):
                return None, False
            current = _stored(row)
            if current.status in TERMINAL:
                return current, False
            after = dataclasses.replace(
                current, status="cancelled", owner=None, lease_until=None, response=response(current.response)
            )
            values = {"status": after.status, "response": _json(after.response), "owner": None, "lease_until": None}
            await conn.execute(responses.update().where(responses.c.id == response_id).values(values))
        return after, True

    # -- the owner's writes ---------------------------------------------------------------------------

    async def commit(
        self, events: Sequence[StoredEvent], changes: Sequence[StatusChange], *, owner: str | None = None
    ) -> set[str]:
        """ONE transaction, one round trip: insert the events, then apply the status changes (each only while the row
        is unfinished and its owner is the change's; a terminal status also clears owner and lease). Returns the ids
        of the responses whose changes or events were not applied (cancelled, taken over or deleted meanwhile), so
        that their runs stop.

        Events go in only for responses that exist and are unfinished, and held by `owner` when it is given (the
        frontend's instance id: then a run that another frontend took over cannot write events). The same commit
        may be retried after a failure that left it unknown whether it committed: events stored already are kept,
        and a change to the status that a finished row already has counts as applied. Of several changes to one
        response, the last one says whether it is refused."""
        if not events and not changes:
            return set()
        batch = _Batch(events, changes)
        await self._open(retry=False)
        async with self._errors_mapped(), self._commit_lock:
            if self._sqlite_thread is not None:
                held = await self._sqlite_thread.call(_sqlite_commit, batch, owner)
            else:
                held = await self._pg_commit(batch, owner)
        return batch.refused(held, owner)

    async def _pg_commit(self, batch: _Batch, owner: str | None) -> dict[str, tuple[str, str | None]]:
        if self._commit_conn is None:
            conn = await self._writes.connect()
            try:
                self._commit_conn = conn, (await conn.get_raw_connection()).driver_connection
            except BaseException:
                await conn.close()
                raise
        conn, driver = self._commit_conn
        try:
            rows = await driver.fetch(_PG_COMMIT, *batch.pg_arguments(owner))
        except BaseException:  # (its state unknown, this connection is not used again)
            self._commit_conn = None
            with contextlib.suppress(*_UNAVAILABLE_ERRORS):
                await conn.invalidate()
                await conn.close()
            raise
        return {rid: (status, holder) for rid, status, holder in rows}

    async def renew(self, owner: str, lease_until: float) -> set[str]:
        """One UPDATE: extend the leases of every unfinished response this owner holds. Returns their ids (the
        service compares them with its runs: a run missing here was cancelled, deleted or taken over)."""
        r = responses.c
        held = sa.select(r.id).where(r.owner == owner, _unfinished).order_by(r.id).with_for_update()
        update = responses.update().where(r.id.in_(held)).values(lease_until=lease_until)
        async with self._transaction(write=True) as conn:
            return set((await conn.execute(update.returning(r.id))).scalars())

    # -- the sweeper ----------------------------------------------------------------------------------

    async def claim_orphans(self, owner: str, now: float, lease_until: float, limit: int = 16) -> list[StoredResponse]:
        """Background, unfinished responses whose lease expired (and not past their TTL), the longest expired first,
        each claimed with a compare-and-set (owner and lease unchanged), so that two frontends sweeping at once never
        both get one."""
        claimed = []
        async with self._transaction(write=True) as conn:
            for orphan in await self._orphans(conn, now, background=True, limit=limit):
                values = {"owner": owner, "lease_until": lease_until}
                row = (await conn.execute(_unchanged(orphan).values(values).returning(*_RESPONSE))).first()
                if row is not None:
                    claimed.append(_stored(row))
        return claimed

    async def fail_orphans(self, now: float, response: Callable[[dict[str, Any]], dict[str, Any]]) -> list[str]:
        """Foreground unfinished responses whose lease expired (their frontend died, and their client with it):
        status failed, response JSON -> response(old), by compare-and-set as in `claim_orphans`. Returns their ids."""
        failed = []
        async with self._transaction(write=True) as conn:
            for orphan in await self._orphans(conn, now, background=False, limit=None):
                new = _json(response(json.loads(orphan.response)))
                values = {"status": "failed", "response": new, "owner": None, "lease_until": None}
                if (await conn.execute(_unchanged(orphan).values(values))).rowcount == 1:
                    failed.append(orphan.id)
        return failed

    async def _orphans(self, conn: AsyncConnection, now: float, *, background: bool, limit: int | None) -> list[sa.Row]:
        r = responses.c
        query = (
            sa.select(r.id, r.owner, r.lease_until, r.response)
            .where(r.lease_until < now, r.background == background, _unfinished, r.created_at >= now - self.ttl_s)
            .order_by(r.lease_until, r.id)
            .limit(limit)
        )
        # (claimed in id order: see the module's docstring)
        return sorted((await conn.execute(query)).all(), key=lambda row: row.id)

    async def expire(self, now: float) -> int:
        """Delete the responses (and their events) older than ttl_s, then, past max_responses, the oldest finished
        ones. Returns how many were deleted."""
        r = responses.c
        deleted = 0
        while True:
            async with self._transaction(write=True) as conn:
                old = sa.select(r.id).where(r.created_at < now - self.ttl_s).order_by(r.created_at, r.id)
                ids = list((await conn.execute(old.limit(DELETE_CHUNK))).scalars())
                deleted += len(await self._delete(conn, ids))
            if len(ids) < DELETE_CHUNK:
                break
        async with self._transaction() as conn:
            excess = (await conn.execute(sa.select(sa.func.count()).select_from(responses))).scalar_one()
        excess -= self.max_responses
        while excess > 0:
            async with self._transaction(write=True) as conn:
                oldest = sa.select(r.id).where(r.status.in_(_SORTED_TERMINAL)).order_by(r.created_at, r.id)
                ids = list((await conn.execute(oldest.limit(min(excess, DELETE_CHUNK)))).scalars())
                deleted += len(await self._delete(conn, ids))
            if not ids:
                break
            excess -= len(ids)
        return deleted

    async def _delete(self, conn: AsyncConnection, ids: list[str]) -> dict[str, float]:
        """Delete these responses and their events; returns the created_at of each that was there. The response
        goes first: a concurrent commit then waits on its row and finds it gone, so no event outlives it."""
        if not ids:
            return {}
        r = responses.c
        rows = await conn.execute(responses.delete().where(r.id.in_(ids)).returning(r.id, r.created_at))
        deleted = {row.id: row.created_at for row in rows}
        if deleted:
            await conn.execute(response_events.delete().where(response_events.c.response_id.in_(sorted(deleted))))
        return deleted


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What a response's changes in one commit come to, if its row is unfinished and held by the changes' owner."""

    final: StatusChange | None  # the change the row ends with (None: none applies)
    took: bool  # whether the last of its changes counts as applied


class _Batch:
    """One commit's events and status changes, prepared once for either database; `refused` reads what it did
    from the rows it locked, as they were before it wrote."""

    def __init__(self, events: Sequence[StoredEvent], changes: Sequence[StatusChange]) -> None:
        self.events = events
        self.event_ids = {e.response_id for e in events}
        by_response: dict[str, list[StatusChange]] = {}
        for c in changes:
            by_response.setdefault(c.response_id, []).append(c)
        self.ids = sorted(self.event_ids | by_response.keys())  # (the locking order)
        # Changes apply in order while their owner holds the row, up to the first terminal one. The holder is
        # known only once the row is locked, so the outcome is prepared for each owner that a change names.
        self.outcomes: dict[tuple[str, str], _Outcome] = {}
        self.last_status = {rid: cs[-1].status for rid, cs in by_response.items()}
        for rid, cs in by_response.items():
            for holder in {c.owner for c in cs}:
                final, finished = None, None
                for c in cs:
                    if finished is None and c.owner == holder:
                        final, finished = c, (c.status if c.status in TERMINAL else None)
                took = final is cs[-1] or (finished is not None and finished == cs[-1].status)
                self.outcomes[rid, holder] = _Outcome(final, took)

    def writable(self, held: dict[str, tuple[str, str | None]], owner: str | None) -> set[str]:
        """The responses whose events go in: there, unfinished, and held by `owner` (when given)."""
        return {
            rid for rid in self.event_ids
            if (state := held.get(rid)) is not None and state[0] not in TERMINAL and owner in (None, state[1])
        }  # fmt: skip

    def applied(self, held: dict[str, tuple[str, str | None]]) -> list[StatusChange]:
        """The change each unfinished row ends with, given its holder."""
        out = []
        for rid, (status, holder) in held.items():
            outcome = self.outcomes.get((rid, holder)) if status not in TERMINAL and holder is not None else None
            if outcome is not None and outcome.final is not None:
                out.append(outcome.final)
        return out

    def refused(self, held: dict[str, tuple[str, str | None]], owner: str | None) -> set[str]:
        refused = set()
        for rid, last in self.last_status.items():
            status, holder = held.get(rid, (None, None))
            if status is not None and status not in TERMINAL:
                outcome = self.outcomes.get((rid, holder)) if holder is not None else None
                took = outcome is not None and outcome.took
            else:  # (a finished row's own status again: this commit retried after its first try committed)
                took = status is not None and status == last
            if not took:
                refused.add(rid)
        return refused | (self.event_ids - self.writable(held, owner) - self.last_status.keys())

    def pg_arguments(self, owner: str | None) -> tuple[Any, ...]:
        """$1 .. $11 of _PG_COMMIT: the ids, the owner, the events' columns, then every prepared outcome's change
        with the holder it is for."""
        columns = list(zip(*self.events, strict=True)) if self.events else [(), (), (), ()]
        finals = [(holder, o.final) for (_, holder), o in self.outcomes.items() if o.final is not None]
        return (
            self.ids,
            owner,
            *columns,
            [c.response_id for _, c in finals],
            [holder for holder, _ in finals],
            [c.status for _, c in finals],
            [_json(c.response) for _, c in finals],
            [c.status in TERMINAL for _, c in finals],
        )


_TERMINAL_SQL = ", ".join(f"'{s}'" for s in _SORTED_TERMINAL)
# One statement, its own transaction. `held` locks the rows in id order and reads them as they are once locked (under
# READ COMMITTED a row another transaction changed meanwhile is read again, as that one committed it); the events go
# in for the rows their owner may write, each change where its holder holds the row; the caller gets `held`.
_PG_COMMIT = f"""
WITH held AS (
    SELECT id, status, owner FROM responses WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE
), stored AS (
    INSERT INTO response_events (response_id, sequence_number, type, data)
    SELECT e.response_id, e.sequence_number, e.type, e.data
    FROM unnest($3::text[], $4::int[], $5::text[], $6::text[]) AS e(response_id, sequence_number, type, data)
    JOIN held AS h ON h.id = e.response_id
    WHERE h.status NOT IN ({_TERMINAL_SQL}) AND ($2::text IS NULL OR h.owner = $2::text)
    ON CONFLICT DO NOTHING
), changed AS (
    UPDATE responses AS r
    SET status = c.status, response = c.response,
        owner = CASE WHEN c.finished THEN NULL ELSE r.owner END,
        lease_until = CASE WHEN c.finished THEN NULL ELSE r.lease_until END
    FROM unnest($7::text[], $8::text[], $9::text[], $10::text[], $11::bool[])
        AS c(response_id, holder, status, response, finished)
    JOIN held AS h ON h.id = c.response_id
    WHERE r.id = c.response_id AND h.owner = c.holder AND h.status NOT IN ({_TERMINAL_SQL})
)
SELECT id, status, owner FROM held
"""

_COLUMNS = ", ".join(c.name for c in responses.c)
_INSERT_RESPONSE = f"INSERT INTO responses ({_COLUMNS}) VALUES ({', '.join('?' * len(responses.c))})"
_INSERT_RESPONSE_PG = (
    f"INSERT INTO responses ({_COLUMNS}) VALUES ({', '.join(f'${i + 1}' for i in range(len(responses.c)))})"
)
_SQLITE_HELD = "SELECT id, status, owner FROM responses WHERE id IN (SELECT value FROM json_each(?))"
_SQLITE_INSERT = "INSERT OR IGNORE INTO response_events (response_id, sequence_number, type, data) VALUES (?, ?, ?, ?)"
_SQLITE_CHANGE = (
    "UPDATE responses SET status = ?, response = ?, owner = CASE WHEN ? THEN NULL ELSE owner END, "
    "lease_until = CASE WHEN ? THEN NULL ELSE lease_until END WHERE id = ?"
)


def _sqlite_commit(conn: sqlite3.Connection, batch: _Batch, owner: str | None) -> dict[str, tuple[str, str | None]]:
    """The whole transaction of a commit, on the SQLite thread. Returns the rows it locked, as they were."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        held = {rid: (status, holder) for rid, status, holder in conn.execute(_SQLITE_HELD, (_json(batch.ids),))}
        writable = batch.writable(held, owner)
        if writable == batch.event_ids:
            conn.executemany(_SQLITE_INSERT, batch.events)
        elif writable:
            conn.executemany(_SQLITE_INSERT, [e for e in batch.events if e.response_id in writable])
        params = []
        for c in batch.applied(held):
            finished = c.status in TERMINAL
            params.append((c.status, _json(c.response), finished, finished, c.response_id))
        if params:
            conn.executemany(_SQLITE_CHANGE, params)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return held


class _SqliteThread:
    """One thread with its own sqlite3 connection, which runs each commit's whole transaction as one call."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None  # (used by the thread only)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="response-store-commits")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._run, fn, args)

    async def close(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            await asyncio.get_running_loop().run_in_executor(executor, self._disconnect)
            executor.shutdown()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        if self._conn is None:
            self._conn = sqlite3.connect(self._path, timeout=SQLITE_BUSY_TIMEOUT_S, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
        try:
            return fn(self._conn, *args)
        except sqlite3.Error as e:
            if not isinstance(e, _CALLER_ERRORS):  # (a connection an I/O error left behind is not trusted again)
                self._disconnect()
            raise

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


def _unchanged(orphan: sa.Row) -> sa.Update:
    """An UPDATE of this orphan that applies only while its owner and lease are what the sweeper read."""
    r = responses.c
    return responses.update().where(
        r.id == orphan.id, r.owner.is_not_distinct_from(orphan.owner), r.lease_until == orphan.lease_until, _unfinished
    )


def _driver_url(url: str) -> URL:
    if "://" not in url:
        return URL.create("sqlite+aiosqlite", database=str(Path(url).expanduser()))
    scheme, rest = url.split("://", 1)
    if scheme in ("postgres", "postgresql", "postgresql+asyncpg"):
        return make_url(f"postgresql+asyncpg://{rest}")
    if scheme in ("sqlite", "sqlite+aiosqlite"):
        parsed = make_url(f"sqlite+aiosqlite://{rest}")
        if not parsed.database or parsed.database == ":memory:":
            raise ValueError(f"the response store needs a database file: sqlite:///path/to/file.db, not {url!r}")
        return parsed
    raise ValueError(f"the response store takes a sqlite:///path or postgresql://host/db URL, not {scheme}://")


def _sqlite_connected(dbapi_connection: Any, _record: Any) -> None:
    # The driver begins no transaction of its own: `_sqlite_begin` says how each one begins.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer, nor it for them
    cursor.close()


def _sqlite_begin(conn: sa.Connection) -> None:
    begin = conn.get_execution_options().get(_BEGIN)
    if begin is not None:
        conn.exec_driver_sql(begin)


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _values(r: StoredResponse) -> tuple[Any, ...]:
    """Its row, in the order of the responses table's columns."""
    return (
        r.id,
        r.created_at,
        r.status,
        r.background,
        r.owner,
        r.lease_until,
        r.previous_response_id,
        _json(r.request),
        _json(r.input_items),
        _json(r.response),
        r.last_sequence_number,
    )


def _stored(row: sa.Row) -> StoredResponse:
    return StoredResponse(
        id=row.id,
        created_at=row.created_at,
        status=row.status,
        background=bool(row.background),
        owner=row.owner,
        lease_until=row.lease_until,
        previous_response_id=row.previous_response_id,
        request=json.loads(row.request),
        input_items=json.loads(row.input_items),
        response=json.loads(row.response),
        last_sequence_number=row.last_sequence_number,
    )
