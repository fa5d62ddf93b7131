"""bench-wire's client (benchmarks/wire_bench.py): it frames keep-alive responses and judges each stream
once it has ended; a checker that passed anything would make the benchmark's "every stream exact" empty."""

from __future__ import annotations

import json

from benchmarks.sse_client import SSEConnection, timed_events
from benchmarks.wire_bench import TEXT, check_stream

OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked(events: list[str]) -> bytes:
    body = b""
    for event in events:
        data = f"data: {event}\n\n".encode()
        body += f"{len(data):x}\r\n".encode() + data + b"\r\n"
    return OK_HEAD + body + b"0\r\n\r\n"


def completion(texts: list[str], finish: str = "length", completion_tokens: int | None = None) -> list[str]:
    events = [
        json.dumps({"choices": [{"index": 0, "text": t, "finish_reason": finish if i == len(texts) - 1 else None}]})
        for i, t in enumerate(texts)
    ]
    tokens = sum(t.count(TEXT) for t in texts) if completion_tokens is None else completion_tokens
    events.append(json.dumps({"choices": [], "usage": {"completion_tokens": tokens}}))
    return [*events, "[DONE]"]


def test_an_exact_stream_counts_its_tokens_and_chunks():
    assert check_stream(chunked(completion([TEXT * 3, TEXT])), max_tokens=4) == (4, 2, None)


def test_what_is_not_exact_is_said():
    tokens, _, error = check_stream(chunked(completion([TEXT * 3])), max_tokens=4)
    assert tokens == 3 and error is not None and "3 tokens" in error
    assert check_stream(chunked(completion([TEXT * 4], finish="stop")), max_tokens=4)[2] is not None
    assert check_stream(chunked(completion([TEXT * 4], completion_tokens=5)), max_tokens=4)[2] is not None
    failed = [json.dumps({"error": {"message": "boom"}}), "[DONE]"]
    assert check_stream(chunked(failed), max_tokens=4)[2] == "boom"
    no_done = completion([TEXT * 4])[:-1]
    assert check_stream(chunked(no_done), max_tokens=4)[2] == "the stream did not end with [DONE]"
    refused = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"
    assert check_stream(refused, max_tokens=4)[2] == "HTTP/1.1 400 Bad Request"


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closed = True


async def test_the_connection_ends_a_response_at_its_last_chunk_however_it_arrives():
    raw = chunked(completion([TEXT * 2]))
    for size in (1, 3, 7, len(raw)):
        connection = SSEConnection()
        connection.connection_made(FakeTransport())
        done = connection.send(b"request")
        pieces = [raw[i : i + size] for i in range(0, len(raw), size)]
        for piece in pieces[:-1]:
            connection.data_received(piece)
            assert not done.done()
        connection.data_received(pieces[-1])
        assert done.done() and b"".join(connection.parts) == raw
        assert check_stream(b"".join(connection.parts), max_tokens=2) == (2, 1, None)


async def test_an_error_answer_closes_the_connection():
    connection = SSEConnection()
    transport = FakeTransport()
    connection.connection_made(transport)
    done = connection.send(b"request")
    for byte in b"HTTP/1.1 503 Service Unavailable\r\n":
        connection.data_received(bytes([byte]))
    assert transport.closed
    connection.connection_lost(None)
    assert done.done() and connection.closed


async def test_each_event_gets_the_arrival_time_of_its_last_byte():
    """serve_bench times tokens from the same client: an event is seen when its last byte came."""
    events = completion([TEXT, TEXT * 2])
    raw = chunked(events)
    first_event_end = raw.index(b"\r\n", raw.index(TEXT.encode()))  # the chunk's CRLF, past the event
    cut = first_event_end - 1  # the first event's last byte comes in the second piece
    connection = SSEConnection()
    connection.connection_made(FakeTransport())
    done = connection.send(b"request")
    for piece in (raw[: cut - 3], raw[cut - 3 : cut + 1], raw[cut + 1 :]):
        connection.data_received(piece)
    assert done.done()
    connection.arrivals = [10.0, 20.0, 30.0]
    error, timed = timed_events(connection)
    assert error is None
    assert [data for _, data in timed] == events
    assert [t for t, _ in timed] == [20.0, 30.0, 30.0, 30.0]


def test_timed_events_says_what_is_wrong():
    connection = SSEConnection()
    connection.connection_made(FakeTransport())
    connection.parts = [b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}"]
    assert timed_events(connection) == ("HTTP/1.1 503 Service Unavailable", [])
    connection.parts = [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    assert timed_events(connection)[0] == "the response is not chunked"
