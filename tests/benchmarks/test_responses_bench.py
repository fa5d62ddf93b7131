"""benchmarks/responses_bench.py reads streams as they came: SSE frames over HTTP pieces, tokens from the usage."""

from __future__ import annotations

import json

from benchmarks.responses_bench import SSEEvent, first_frame_sequence, sse_events, tally_chat, tally_responses
from benchmarks.serve_bench import RequestRecord


def frame(kind: str, event: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()


def test_a_frame_split_over_pieces_counts_when_its_last_piece_came():
    first = frame("response.created", {"type": "response.created", "sequence_number": 0})
    second = frame("response.output_text.delta", {"sequence_number": 1, "delta": "hi"})
    events = sse_events([(first + second[:10], 1.0), (second[10:], 2.0), (b'data: {"a": 1}\n\n', 3.0)])
    assert [(e.arrived, e.type) for e in events] == [
        (1.0, "response.created"),
        (2.0, "response.output_text.delta"),
        (3.0, ""),
    ]
    assert json.loads(events[1].data)["delta"] == "hi" and events[2].data == '{"a": 1}'


def test_responses_tokens_come_from_the_terminal_usage_and_text_deltas_time_them():
    def event(at: float, kind: str, **fields) -> SSEEvent:
        return SSEEvent(at, kind, json.dumps({"type": kind, **fields}))

    events = [
        event(0.1, "response.created"),
        event(0.2, "response.output_text.delta", delta="a"),
        event(0.3, "response.output_text.delta", delta="b"),
        event(0.4, "response.incomplete", response={"usage": {"output_tokens": 2}}),
    ]
    rec = RequestRecord(sent=0.0)
    tally_responses(events, rec)
    assert (rec.first, rec.last, rec.tokens, rec.chunks, rec.error) == (0.2, 0.3, 2, 4, None)
    cut = RequestRecord(sent=0.0)
    tally_responses(events[:3], cut)
    assert cut.error is not None and "3 events" in cut.error


def test_chat_tokens_come_from_the_usage_chunk_and_the_role_chunk_is_no_token():
    chunks = [
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"content": "a"}}]},
        {"choices": [], "usage": {"completion_tokens": 1}},
    ]
    events = [SSEEvent(0.1 * (i + 1), "", json.dumps(c)) for i, c in enumerate(chunks)] + [SSEEvent(0.5, "", "[DONE]")]
    rec = RequestRecord(sent=0.0)
    tally_chat(events, rec)
    assert (rec.first, rec.last, rec.tokens, rec.chunks, rec.error) == (0.2, 0.2, 1, 1, None)
    unfinished = RequestRecord(sent=0.0)
    tally_chat(events[:-1], unfinished)
    assert unfinished.error is not None


def test_the_first_whole_frame_of_a_chunked_response_gives_its_sequence_number():
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    body = frame("response.output_text.delta", {"type": "response.output_text.delta", "sequence_number": 17})
    chunk = f"{len(body):x}\r\n".encode() + body + b"\r\n"
    assert first_frame_sequence(head) is None
    assert first_frame_sequence(head + chunk[:-8]) is None
    assert first_frame_sequence(head + chunk + chunk) == 17
