"""What a slow or malformed client may hold of the server: uvicorn's httptools protocol with read bounds.

uvicorn times out only idle keep-alive connections: a client that opens a socket and sends a header a
byte at a time, or a body slower than any real client, holds the connection (and a file descriptor)
for as long as it likes, and a header of any size is read in full. Here each request's headers must
arrive within `header_timeout_s` and within `max_header_bytes` (past it: a 431), and its body must not
stall for `body_timeout_s`; the connection is closed otherwise, and a request whose body stalled sees
its client disconnect (its engine work is cancelled as for any disconnect).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True, slots=True)
class ReadLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024


def _error_response(status: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n\r\n{body}"
    ).encode()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol whose requests' headers and bodies are read within `limits` (a subclass sets them)."""

    limits = ReadLimits()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._in_headers = True  # between a request's first byte (or the connection's start) and its headers' end
        self._in_body = False
        self._header_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(
                "431 Request Header Fields Too Large",
                f"the request line and headers exceed {self.limits.max_header_bytes} bytes",
                "request_header_fields_too_large",
            )
        elif self._in_body:
            self._arm(self.limits.body_timeout_s)  # (an idle bound: each chunk restarts it)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # a keep-alive connection's next request
            self._in_headers = True
            self._arm(self.limits.header_timeout_s)

    def on_headers_complete(self) -> None:
        self._in_headers, self._in_body, self._header_bytes = False, True, 0
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._disarm()
        super().on_message_complete()

    def _arm(self, delay: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_headers and (self.cycle is None or self.cycle.response_complete):
            self._refuse("408 Request Timeout", "the request's headers did not arrive in time", "request_timeout")
        else:  # a stalled body: the request sees its client disconnect
            self.transport.close()

    def _refuse(self, status: str, message: str, code: str) -> None:
        self._disarm()
        self.transport.write(_error_response(status, message, code))
        self.transport.close()


def bounded_protocol(limits: ReadLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class uvicorn's `http` setting takes, reading requests within `limits`."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})
