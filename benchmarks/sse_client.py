"""The benchmarks' HTTP client for streamed completions: keep-alive HTTP/1.1, bytes kept as they come.

The benchmarks run their client on the same two cores as the servers they measure, so the client must
cost as little as it can: a client that parses every SSE event as it arrives (httpx is pure Python)
spends more CPU per token than the frontend itself, and that CPU is taken from the servers. This one
keeps each piece that arrives with the time it came and parses a response once it has ended: every
SSE event then gets the arrival time of its last byte, which is when a client that parsed as it went
would have seen it. `run` runs a client on uvloop, whose loop takes less CPU per arriving event than
asyncio's own (figures: docs/performance.md).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")

_LAST_CHUNK = b"\r\n0\r\n\r\n"  # the end of a chunked body (the CRLF closes the chunk before it)
STATUS_OK = b"HTTP/1.1 200"


def run(client: Coroutine[Any, Any, T]) -> T:
    """Runs a client coroutine to its end on a fresh uvloop event loop (what asyncio.run does)."""
    return uvloop.run(client)


def post_request(host: str, port: int, path: str, body: dict) -> bytes:
    """The bytes of one POST with a JSON body, to send again and again on a keep-alive connection."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


class SSEConnection(asyncio.Protocol):
    """One keep-alive connection that keeps what arrives, and when, and nothing more."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.arrivals: list[float] = []  # perf_counter when each part came
        self.ends: list[int] = []  # bytes received up to the end of each part
        self.done: asyncio.Future[None] | None = None
        self.closed = False
        self._received = 0
        self._status_checked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def send(self, request: bytes) -> asyncio.Future[None]:
        """Sends one request; the future is done once its whole response has come (or the connection closed)."""
        self.parts, self.arrivals, self.ends = [], [], []
        self._received, self._status_checked = 0, False
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.done

    def data_received(self, data: bytes) -> None:
        self.arrivals.append(time.perf_counter())
        self.parts.append(data)
        self._received += len(data)
        self.ends.append(self._received)
        if not self._status_checked and self._received >= len(STATUS_OK):
            self._status_checked = True
            if not b"".join(self.parts).startswith(STATUS_OK):
                self.transport.close()  # an error answer: its status line is what the caller reports
                return
        tail = data if len(data) >= len(_LAST_CHUNK) else b"".join(self.parts)[-len(_LAST_CHUNK) :]
        if self._status_checked and tail.endswith(_LAST_CHUNK):
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def response(self) -> bytes:
        return b"".join(self.parts)

    def arrival_of(self, offset: int) -> float:
        """When the byte at `offset` of the response arrived."""
        return self.arrivals[min(bisect.bisect_right(self.ends, offset), len(self.arrivals) - 1)]


def http_chunks(body: bytes) -> list[tuple[bytes, int]]:
    """An HTTP/1.1 chunked body -> each chunk's bytes and the offset just past it in `body`."""
    out, i = [], 0
    while True:
        eol = body.index(b"\r\n", i)
        size = int(body[i:eol].split(b";")[0], 16)
        if size == 0:
            return out
        out.append((body[eol + 2 : eol + 2 + size], eol + 2 + size))
        i = eol + 2 + size + 2


def dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body -> its bytes."""
    return b"".join(chunk for chunk, _ in http_chunks(body))


def timed_events(connection: SSEConnection) -> tuple[str | None, list[tuple[float, str]]]:
    """The response on `connection` -> (what was wrong with it or None, [(arrival time, SSE data)])."""
    raw = connection.response()
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(STATUS_OK):
        return head.split(b"\r\n")[0].decode(errors="replace") or "no response", []
    if b"transfer-encoding: chunked" not in head.lower():
        return "the response is not chunked", []
    start = len(head) + len(sep)
    events = []
    try:
        chunks = http_chunks(body)
    except ValueError:
        return "the response ended before its last chunk", []
    for chunk, end in chunks:
        arrived = connection.arrival_of(start + end - 1)
        events += [(arrived, e[6:]) for e in chunk.decode().split("\n\n") if e.startswith("data: ")]
    return None, events
