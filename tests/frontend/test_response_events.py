"""ResponseEvents: OpenAI's stream events from output operations, and a run restored from its sent events.

Every event is validated as the SDK's `ResponseStreamEvent` and every final response as its `Response`, so the
real SDK parses what the frontend sends.
"""

from __future__ import annotations

import typing
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseError, ResponseStreamEvent
from pydantic import TypeAdapter

from openai_frontend.responses_api.events import OPENAI_ERROR_CODES, Diverged, Event, ResponseEvents

STREAM_EVENT = TypeAdapter(ResponseStreamEvent)
USAGE = {
    "input_tokens": 12,
    "input_tokens_details": {"cached_tokens": 4},
    "output_tokens": 9,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 21,
}
SKELETON: dict[str, Any] = {
    "id": "resp_0123456789abcdef0123456789abcdef",
    "object": "response",
    "created_at": 1_700_000_000,
    "status": "queued",
    "model": "tiny",
    "output": [],
    "parallel_tool_calls": True,
    "tool_choice": "auto",
    "tools": [],
    "usage": None,
    "error": None,
    "incomplete_details": None,
    "instructions": None,
    "metadata": {},
    "temperature": 1.0,
    "top_p": 1.0,
    "max_output_tokens": None,
    "previous_response_id": None,
    "store": True,
    "background": True,
}

Op = tuple[Any, ...]
START: list[Op] = [("created",), ("in_progress",)]
TEXT = START + [("text", "Hel"), ("text", "lo, "), ("text", "wörld!"), ("finish", USAGE)]
TEXT_CALLS = START + [
    ("text", "Let me "),
    ("text", "check."),
    ("call", 0, "get_weather", "call_a"),
    ("arguments", 0, '{"city": '),
    ("arguments", 0, '"Paris"}'),
    ("call", 1, "get_time", "call_b"),
    ("arguments", 1, '{"tz": "CET"}'),
    ("finish", USAGE),
]
NAMED = START + [
    ("call", 0, "lookup", "call_n"),
    ("arguments", 0, '{"q":'),
    ("arguments", 0, ' "x"}'),
    ("finish", USAGE),
]
INCOMPLETE = START + [("text", "A long "), ("text", "story"), ("finish", USAGE, "max_output_tokens")]
FAILED = START + [("text", "Part"), ("text", "ial"), ("fail", "server_error", "the engine stopped")]
EMPTY = START + [("finish", USAGE)]
SCENARIOS = {"text": TEXT, "text_calls": TEXT_CALLS, "named": NAMED, "incomplete": INCOMPLETE, "failed": FAILED}


def run(builder: ResponseEvents, ops: list[Op]) -> list[Event]:
    events: list[Event] = []
    for name, *args in ops:
        events += getattr(builder, name)(*args)
    return events


def check_stream(events: list[Event], validate_from: int = 0) -> dict[str, Any]:
    """Asserts `events` is one coherent stream and returns its final response (validated by the SDK)."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    for event in events[validate_from:]:
        STREAM_EVENT.validate_python(event)
    items: list[str] = []  # item ids by output index
    deltas: dict[str, list[str]] = defaultdict(list)
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == len(items)
            items.append(event["item"]["id"])
        elif "item_id" in event:
            assert items[event["output_index"]] == event["item_id"]
            if kind.endswith(".delta"):
                deltas[event["item_id"]].append(event["delta"])
            elif kind == "response.output_text.done":
                assert event["text"] == "".join(deltas[event["item_id"]])
            elif kind == "response.content_part.done":
                assert event["part"]["text"] == "".join(deltas[event["item_id"]])
            elif kind == "response.function_call_arguments.done":
                assert event["arguments"] == "".join(deltas[event["item_id"]])
        elif kind == "response.output_item.done":
            item = event["item"]
            content = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
            assert content == "".join(deltas[item["id"]])
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert [item["id"] for item in final["output"]] == items
    text = ""
    for item in final["output"]:
        if item["type"] == "function_call":
            assert item["arguments"] == "".join(deltas[item["id"]])
        else:
            joined = "".join(part["text"] for part in item["content"])
            assert joined == "".join(deltas[item["id"]])
            text += joined
    assert Response.model_validate(final).output_text == text
    return final


def types(events: list[Event]) -> list[str]:
    return [event["type"].removeprefix("response.") for event in events]


def test_plain_text() -> None:
    builder = ResponseEvents(SKELETON)
    events = run(builder, TEXT)
    assert types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        "completed",
    ]
    final = check_stream(events)
    assert Response.model_validate(final).output_text == "Hello, wörld!"
    assert events[0]["response"]["status"] == "queued" and events[1]["response"]["status"] == "in_progress"
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 9
    assert final["output"][0]["id"].startswith("msg_") and len(final["output"][0]["id"]) == 4 + 32
    assert final["output"][0]["status"] == "completed"
    assert builder.finished and builder.response == final and builder.next_sequence_number == len(events)


def test_text_then_two_calls() -> None:
    events = run(ResponseEvents(SKELETON), TEXT_CALLS)
    call = ["output_item.added", "function_call_arguments.delta"]
    closing = ["function_call_arguments.done", "output_item.done"]
    assert types(events) == [
        "created",
        "in_progress",
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "output_text.done",
        "content_part.done",
        "output_item.done",
        *call,
        "function_call_arguments.delta",
        *closing,
        *call,
        *closing,
        "completed",
    ]
    final = check_stream(events)
    message, weather, clock = final["output"]
    assert Response.model_validate(final).output_text == "Let me check."
    assert (weather["name"], weather["call_id"], weather["arguments"]) == ("get_weather", "call_a", '{"city": "Paris"}')
    assert (clock["name"], clock["call_id"], clock["arguments"]) == ("get_time", "call_b", '{"tz": "CET"}')
    assert weather["id"].startswith("fc_") and weather["status"] == clock["status"] == "completed"
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    assert added[1]["status"] == "in_progress" and added[1]["arguments"] == ""


def test_named_call_only() -> None:
    events = run(ResponseEvents(SKELETON), NAMED)
    assert types(events)[2:] == [
        "output_item.added",
        "function_call_arguments.delta",
        "function_call_arguments.delta",
        "function_call_arguments.done",
        "output_item.done",
        "completed",
    ]
    final = check_stream(events)
    assert final["output"][0]["arguments"] == '{"q": "x"}' and Response.model_validate(final).output_text == ""


def test_incomplete() -> None:
    events = run(ResponseEvents(SKELETON), INCOMPLETE)
    assert types(events)[-4:] == ["output_text.done", "content_part.done", "output_item.done", "incomplete"]
    final = check_stream(events)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and "completed_at" not in final


def test_failed_mid_text() -> None:
    events = run(ResponseEvents(SKELETON), FAILED)
    assert types(events)[2:] == [
        "output_item.added",
        "content_part.added",
        "output_text.delta",
        "output_text.delta",
        "error",
        "failed",
    ]
    assert events[-2] == {
        "type": "error",
        "sequence_number": 6,
        "code": "server_error",
        "message": "the engine stopped",
        "param": None,
    }
    final = check_stream(events)
    assert final["status"] == "failed" and final["error"] == {"code": "server_error", "message": "the engine stopped"}
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Partial"


def test_empty_output() -> None:
    events = run(ResponseEvents(SKELETON), EMPTY)
    assert types(events) == ["created", "in_progress", "completed"]
    final = check_stream(events)
    assert final["output"] == [] and final["status"] == "completed" and final["completed_at"] >= SKELETON["created_at"]


def test_a_code_outside_openais_is_sent_in_the_error_event_only() -> None:
    sdk_codes = set(typing.get_args(ResponseError.model_fields["code"].annotation))
    assert sdk_codes >= OPENAI_ERROR_CODES
    events = run(ResponseEvents(SKELETON), START + [("text", "x"), ("fail", "diverged", "regenerated text differs")])
    assert events[-2]["code"] == "diverged" and events[-1]["response"]["error"]["code"] == "server_error"
    check_stream(events)


def test_sent_events_do_not_change_afterwards() -> None:
    builder = ResponseEvents(SKELETON)
    created = builder.created()[0]
    added = builder.text("abc")[0]
    builder.text("def")
    builder.finish(USAGE)
    assert created["response"]["output"] == [] and created["response"]["status"] == "queued"
    assert added["item"]["content"] == [] and added["item"]["status"] == "in_progress"


def test_empty_deltas_emit_nothing_and_usage_details_default_to_zero() -> None:
    builder = ResponseEvents(SKELETON)
    assert builder.text("") == [] and builder.response["output"] == []
    events = builder.finish({"input_tokens": 1, "output_tokens": 0, "total_tokens": 1})
    assert events[-1]["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    STREAM_EVENT.validate_python(events[-1])


def test_arguments_of_a_call_that_is_not_open_are_refused() -> None:
    builder = ResponseEvents(SKELETON)
    builder.call(0, "f", "call_f")
    builder.text("after")
    with pytest.raises(ValueError):
        builder.arguments(0, "{}")
    with pytest.raises(ValueError):
        builder.arguments(3, "{}")


# --- restore -----------------------------------------------------------------------------------------------------


def regroup(ops: list[Op], data: st.DataObject) -> list[Op]:
    """The same operations with each item's content split at other points, and fresh call_ids."""
    out: list[Op] = []
    pending: tuple[Op, str] | None = None  # (the op with its content left out, the content so far)

    def flush() -> None:
        if pending is None:
            return
        head, content = pending
        cuts = sorted(data.draw(st.sets(st.integers(1, len(content) - 1))) if len(content) > 1 else set())
        bounds = [0, *cuts, len(content)]
        out.extend((*head, content[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))

    for op in ops:
        if op[0] in ("text", "arguments"):
            head = op[:-1]
            if pending is not None and pending[0] == head:
                pending = (head, pending[1] + op[-1])
            else:
                flush()
                pending = (head, op[-1])
            continue
        flush()
        pending = None
        out.append(("call", op[1], op[2], f"call_replay_{op[1]}") if op[0] == "call" else op)
    flush()
    return out


def normalized(final: dict[str, Any], begun: int) -> dict[str, Any]:
    """`final` with the ids of items begun after the first `begun` (fresh in each run) and its clock left out."""
    final = {key: value for key, value in final.items() if key != "completed_at"}
    final["output"] = [
        item if index < begun else {key: value for key, value in item.items() if key not in ("id", "call_id")}
        for index, item in enumerate(final["output"])
    ]
    return final


@pytest.mark.parametrize("name", SCENARIOS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_restore_at_every_cut(name: str, data: st.DataObject) -> None:
    ops = SCENARIOS[name]
    full = run(ResponseEvents(SKELETON), ops)
    final = check_stream(full)
    for k in range(len(full)):
        sent = full[: k + 1]
        builder = ResponseEvents.restore(SKELETON, sent)
        assert builder.next_sequence_number == k + 1
        stream = sent + run(builder, regroup(ops, data))
        got = check_stream(stream, validate_from=k + 1)
        begun = sum(event["type"] == "response.output_item.added" for event in sent)
        assert normalized(got, begun) == normalized(final, begun)
        replay_ids = [item.get("call_id") for item in got["output"][begun:] if item["type"] == "function_call"]
        assert all(call_id.startswith("call_replay_") for call_id in replay_ids)
        assert builder.finished and builder.response == got


def test_restored_after_the_terminal_event_emits_nothing() -> None:
    full = run(ResponseEvents(SKELETON), TEXT_CALLS)
    builder = ResponseEvents.restore(SKELETON, full)
    assert builder.finished and run(builder, TEXT_CALLS) == [] and builder.response == full[-1]["response"]


def test_restored_after_the_error_event_sends_only_response_failed() -> None:
    full = run(ResponseEvents(SKELETON), FAILED)
    builder = ResponseEvents.restore(SKELETON, full[:-1])
    new = run(builder, TEXT)  # the regenerated run goes further; what clients saw was the error
    assert types(new) == ["failed"]
    assert check_stream(full[:-1] + new)["error"]["message"] == "the engine stopped"


def cut_after(events: list[Event], text: str) -> list[Event]:
    """The events up to the first whose joined deltas so far contain `text`."""
    joined = ""
    for index, event in enumerate(events):
        joined += event.get("delta", "")
        if text in joined:
            return events[: index + 1]
    raise AssertionError(text)


@pytest.mark.parametrize(
    ("original", "cut", "replayed"),
    [
        (TEXT, "Hello", TEXT[:3] + [("text", "p!")] + TEXT[-1:]),  # a different character
        (TEXT_CALLS, '{"city', TEXT_CALLS[:4] + [("call", 0, "get_wind", "call_x")] + TEXT_CALLS[5:]),  # another name
        (TEXT_CALLS, "Let", START + [("call", 0, "f", "call_f"), ("finish", USAGE)]),  # a call where text was sent
        (TEXT_CALLS, "Let me check", START + [("text", "Let me")] + TEXT_CALLS[-1:]),  # less text than was sent
        (TEXT_CALLS, '{"city', TEXT_CALLS[:4] + TEXT_CALLS[-1:]),  # no call where one was sent
        (TEXT, None, TEXT[:-1] + [("text", " more")]),  # more text after the item was sent complete
    ],
)
def test_restore_raises_diverged_and_can_still_fail(original: list[Op], cut: str | None, replayed: list[Op]) -> None:
    full = run(ResponseEvents(SKELETON), original)
    sent = full[:-1] if cut is None else cut_after(full, cut)
    builder = ResponseEvents.restore(SKELETON, sent)
    new: list[Event] = []
    with pytest.raises(Diverged):
        for op_name, *args in replayed:
            new += getattr(builder, op_name)(*args)
    new += builder.fail("diverged", "the regenerated output differs from what was sent")
    final = check_stream(sent + new, validate_from=len(sent))
    assert final["status"] == "failed" and new[-2]["code"] == "diverged"
