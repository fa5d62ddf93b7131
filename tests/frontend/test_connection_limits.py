"""Slow and malformed clients against the real uvicorn server with the frontend's protocol: a header sent
a byte at a time, a stalled body and an oversized header each lose their connection within their bound,
and a normal request on another connection is served meanwhile."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from openai_frontend.app import create_app
from openai_frontend.connection_limits import ReadLimits, bounded_protocol
from scripts.servers import free_port
from tests.fake_engine import FakeEngineClient

LIMITS = ReadLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_header_bytes=4096)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        create_app(FakeEngineClient()), host="127.0.0.1", port=port, http=bounded_protocol(LIMITS), log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(10)


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.settimeout(10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (a timeout here fails the test)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def health(port: int) -> bytes:
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return read_all(sock)


def test_a_header_sent_a_byte_at_a_time_is_cut_off(port):
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(4):  # slower than the bound allows
            time.sleep(0.4)
            try:
                sock.sendall(b"X")
            except OSError:
                break
        reply = read_all(sock)
        assert time.monotonic() - start < LIMITS.header_timeout_s + 5
    assert reply.startswith(b"HTTP/1.1 408")
    assert b"200 OK" in health(port)


def test_an_idle_connection_that_sends_nothing_is_closed(port):
    with connect(port) as sock:
        start = time.monotonic()
        assert read_all(sock).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - start < LIMITS.header_timeout_s + 5


def test_a_stalled_body_loses_its_connection(port):
    with connect(port) as sock:
        start = time.monotonic()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model":'
        )
        read_all(sock)
        assert time.monotonic() - start < LIMITS.body_timeout_s + 5
    assert b"200 OK" in health(port)


def test_an_oversized_header_is_a_431(port):
    with connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (2 * LIMITS.max_header_bytes))
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431") and b"request_header_fields_too_large" in reply


def test_keep_alive_requests_each_get_the_header_bound_again(port):
    with connect(port) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply:
                reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200")
            time.sleep(LIMITS.header_timeout_s * 0.6)  # under the bound each time, over it in total
