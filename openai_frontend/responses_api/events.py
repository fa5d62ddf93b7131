"""The stream events of one response (OpenAI's Responses API), built from its output operations.

A run calls `text`, `call` and `arguments` as the engine's steps come, then `finish` or `fail`; each call returns the
events to send, numbered from 0 by 1 (docs/responses.md lists their order). The builder holds each item's content as
a list of deltas and joins it only when an event or a snapshot needs the whole text, so a token costs one small dict.

`restore` continues a run that another process began: it rebuilds what the stored events sent and then expects the
same operations again from the first token. Content is compared per output item, character by character, so a
regenerated run may group its deltas differently from the original; only what goes past the sent events is emitted.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Event = dict[str, Any]  # one stream event: {"type": ..., "sequence_number": n, ...}, JSON-ready
ItemKind = Literal["message", "function_call"]

# `Response.error.code` is one of OpenAI's codes; any other code (such as "diverged") goes out in the `error` event,
# which takes any string, and the response itself says "server_error", so typed clients still parse it.
OPENAI_ERROR_CODES = frozenset(
    {
        "server_error",
        "rate_limit_exceeded",
        "invalid_prompt",
        "vector_store_timeout",
        "invalid_image",
        "invalid_image_format",
        "invalid_base64_image",
        "invalid_image_url",
        "image_too_large",
        "image_too_small",
        "image_parse_error",
        "image_content_policy_violation",
        "invalid_image_mode",
        "image_file_too_large",
        "unsupported_image_media_type",
        "empty_image_file",
        "failed_to_download_image",
        "image_file_not_found",
    }
)

_ADDED, _DONE = "response.output_item.added", "response.output_item.done"
_PART_ADDED, _PART_DONE = "response.content_part.added", "response.content_part.done"
_OPENING: dict[str, tuple[str, ...]] = {"message": (_ADDED, _PART_ADDED), "function_call": (_ADDED,)}
# The first closing event fixes the item's content: nothing can be added to it after that one is sent.
_CLOSING: dict[str, tuple[str, ...]] = {
    "message": ("response.output_text.done", _PART_DONE, _DONE),
    "function_call": ("response.function_call_arguments.done", _DONE),
}
_DELTA = {"message": "response.output_text.delta", "function_call": "response.function_call_arguments.delta"}
_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_ID_PREFIX = {"message": "msg_", "function_call": "fc_"}


class Diverged(Exception):
    """A regenerated run's output differs from what was already sent (see `ResponseEvents.restore`)."""


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass(slots=True, eq=False)
class _Item:
    """One output item: its content (message text or call arguments) and which of its events are sent."""

    kind: ItemKind
    id: str
    output_index: int
    name: str = ""  # of a call
    call_id: str = ""
    parts: list[str] = field(default_factory=list)  # the content's deltas, joined on demand
    sent: str = ""  # content a previous process sent: the regenerated run repeats it before adding to it
    verified: int = 0  # characters of `sent` the regenerated run has repeated
    emitted: set[str] = field(default_factory=set)  # this item's event types already sent (deltas aside)
    status: str = "in_progress"

    @property
    def content(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "status": self.status,
                "arguments": self.content,
                "call_id": self.call_id,
                "name": self.name,
            }
        content = [_text_part(self.content)] if _PART_ADDED in self.emitted else []
        return {"id": self.id, "type": "message", "status": self.status, "role": "assistant", "content": content}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's usage object; the details a caller leaves out are zero."""
    usage = copy.deepcopy(usage)
    usage["input_tokens_details"] = {
        "cached_tokens": 0,
        "cache_write_tokens": 0,
        **usage.get("input_tokens_details", {}),
    }
    usage["output_tokens_details"] = {"reasoning_tokens": 0, **usage.get("output_tokens_details", {})}
    return usage


class ResponseEvents:
    """The events of one response, from its operations; a fresh builder numbers them from 0."""

    def __init__(self, response: dict[str, Any]) -> None:
        """`response`: the response object skeleton (status "queued" or "in_progress", output [], usage None)."""
        self._response = copy.deepcopy(response)
        self._items: list[_Item] = []  # the response's output
        self._calls: dict[int, _Item] = {}  # by the run's call index
        self._open: _Item | None = None  # the item the run writes to
        self._reached = 0  # items the run has begun; fewer than _items while a restored run repeats them
        self._seq = 0
        self._sent: set[str] = set()  # response-level events already sent: created, in_progress
        self._error: tuple[str, str] | None = None  # (code, message) of the sent `error` event
        self._final: dict[str, Any] | None = None  # the response of the sent terminal event

    @property
    def response(self) -> dict[str, Any]:
        """The response object as of now (a copy)."""
        if self._final is not None:
            return copy.deepcopy(self._final)
        snapshot = copy.deepcopy({key: value for key, value in self._response.items() if key != "output"})
        snapshot["output"] = [item.to_dict() for item in self._items]
        return snapshot

    @property
    def next_sequence_number(self) -> int:
        return self._seq

    @property
    def finished(self) -> bool:
        return self._final is not None

    def created(self) -> list[Event]:
        return self._response_event("response.created")

    def in_progress(self) -> list[Event]:
        if self._final is None:
            self._response["status"] = "in_progress"
        return self._response_event("response.in_progress")

    def text(self, delta: str) -> list[Event]:
        """Assistant text; opens a message item when none is open."""
        if not delta or self._halted():
            return []
        item = self._open
        if item is not None and item.kind == "message":
            return self._add(item, delta)
        events = self._begin("message", "", "")
        return events + self._add(self._open, delta)  # type: ignore[arg-type]

    def call(self, index: int, name: str, call_id: str) -> list[Event]:
        """Function call `index` starts; `call_id` is ignored when a restored run already sent this call."""
        if self._halted():
            return []
        if index in self._calls:
            raise ValueError(f"function call {index} has already begun")
        events = self._begin("function_call", name, call_id)
        self._calls[index] = self._open  # type: ignore[assignment]
        return events

    def arguments(self, index: int, delta: str) -> list[Event]:
        if not delta or self._halted():
            return []
        item = self._calls.get(index)
        if item is None or item is not self._open:
            raise ValueError(f"function call {index} is not the open output item")
        return self._add(item, delta)

    def finish(self, usage: dict[str, Any], incomplete_reason: str | None = None) -> list[Event]:
        """Closes the open item; `response.completed`, or `response.incomplete` with `incomplete_reason`."""
        if self._final is not None:
            return []
        if self._error is not None:  # clients saw the error: only response.failed can follow it
            return self._failed()
        if self._open is not None:
            self._check_repeated(self._open)
        if self._reached < len(self._items):
            raise Diverged(f"the regenerated run ends before output item {self._reached}, which was sent")
        events = self._close("incomplete" if incomplete_reason else "completed")
        self._response["usage"] = _usage(usage)
        if incomplete_reason:
            self._response["status"] = "incomplete"
            self._response["incomplete_details"] = {"reason": incomplete_reason}
            events.append(self._terminal("response.incomplete"))
        else:
            self._response["status"] = "completed"
            self._response["completed_at"] = int(time.time())
            events.append(self._terminal("response.completed"))
        return events

    def fail(self, code: str, message: str) -> list[Event]:
        """An `error` event, then `response.failed`; items still open stay so, as status incomplete."""
        if self._final is not None:
            return []
        events = []
        if self._error is None:
            self._error = (code, message)
            events.append(self._emit("error", code=code, message=message, param=None))
        return events + self._failed()

    @classmethod
    def restore(cls, response: dict[str, Any], events: Sequence[Event]) -> ResponseEvents:
        """A builder that continues a run another process began.

        `response` is the skeleton as at creation; `events` are the events already sent (sequence numbers from 0, a
        complete prefix). The builder expects the same operations again from the start: what repeats sent content
        emits nothing, what goes past it is emitted as new events numbered on. Items already begun keep their stored
        ids and call_ids. Regenerated content that contradicts what was sent (a different character, another kind
        of item, another call name, less content than was sent) raises `Diverged`. After a terminal event, every
        operation emits nothing.
        """
        builder = cls(response)
        for number, event in enumerate(events):
            if event["sequence_number"] != number:
                raise ValueError(f"stored event {number} has sequence number {event['sequence_number']}")
            builder._absorb(event)
        for item in builder._items:
            item.sent = item.content
        builder._seq = len(events)
        return builder

    def _absorb(self, event: Event) -> None:
        """Takes in the state one sent event implies."""
        kind = event["type"]
        if kind in ("response.created", "response.in_progress"):
            self._sent.add(kind)
            if kind == "response.in_progress":
                self._response["status"] = "in_progress"
        elif kind == "error":
            self._error = (event.get("code") or "server_error", event["message"])
        elif kind in _TERMINAL:
            self._final = copy.deepcopy(event["response"])
        elif kind == _ADDED:
            raw = event["item"]
            if raw["type"] not in _OPENING or event["output_index"] != len(self._items):
                raise ValueError(f"stored event {event['sequence_number']} adds an unexpected output item")
            item = _Item(raw["type"], raw["id"], len(self._items), raw.get("name", ""), raw.get("call_id", ""))
            item.emitted.add(kind)
            self._items.append(item)
        else:
            item = self._items[event["output_index"]]
            if kind == _DELTA[item.kind]:
                item.parts.append(event["delta"])
            elif kind in _OPENING[item.kind] or kind in _CLOSING[item.kind]:
                item.emitted.add(kind)
                if kind == _DONE:
                    item.status = event["item"]["status"]
            else:
                raise ValueError(f"stored event {event['sequence_number']} has an unexpected type {kind}")

    def _halted(self) -> bool:
        return self._final is not None or self._error is not None

    def _emit(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response_event(self, kind: str) -> list[Event]:
        if kind in self._sent or self._halted():
            return []
        self._sent.add(kind)
        return [self._emit(kind, response=self.response)]

    def _add(self, item: _Item, delta: str) -> list[Event]:
        """Content for `item`: the part that repeats sent content is checked, the rest is appended and emitted."""
        if item.verified < len(item.sent):
            old = item.sent[item.verified : item.verified + len(delta)]
            if delta[: len(old)] != old:
                raise Diverged(f"output item {item.output_index} differs from the content that was sent")
            item.verified += len(old)
            delta = delta[len(old) :]
            if not delta:
                return []
        if _CLOSING[item.kind][0] in item.emitted:
            raise Diverged(f"output item {item.output_index} was sent complete; the regenerated run continues it")
        item.parts.append(delta)
        if item.kind == "message":
            event = {
                "type": "response.output_text.delta",
                "sequence_number": self._seq,
                "item_id": item.id,
                "output_index": item.output_index,
                "content_index": 0,
                "delta": delta,
                "logprobs": [],
            }
        else:
            event = {
                "type": "response.function_call_arguments.delta",
                "sequence_number": self._seq,
                "item_id": item.id,
                "output_index": item.output_index,
                "delta": delta,
            }
        self._seq += 1
        return [event]

    def _check_repeated(self, item: _Item) -> None:
        if item.verified < len(item.sent):
            raise Diverged(f"output item {item.output_index} ends before the content that was sent")

    def _begin(self, kind: ItemKind, name: str, call_id: str) -> list[Event]:
        """Closes the open item and opens the next one: a new item, or the restored one at that index."""
        # Every check comes before any change, so that after Diverged the builder can still fail the response.
        if self._open is not None:
            self._check_repeated(self._open)
        index = self._reached
        item = self._items[index] if index < len(self._items) else None
        if item is not None and (item.kind != kind or item.name != name):
            raise Diverged(f"output item {index} was sent as a {item.kind} {item.name!r}, not a {kind} {name!r}")
        events = self._close("completed")
        if item is None:
            item = _Item(kind, _ID_PREFIX[kind] + uuid.uuid4().hex, index, name, call_id)
            self._items.append(item)
        self._reached += 1
        self._open = item
        events.extend(self._item_event(item, kind_) for kind_ in _OPENING[kind] if kind_ not in item.emitted)
        return events

    def _close(self, status: str) -> list[Event]:
        """The closing events of the open item that are not sent yet."""
        item, self._open = self._open, None
        if item is None:
            return []
        if _DONE not in item.emitted:
            item.status = status
        return [self._item_event(item, kind) for kind in _CLOSING[item.kind] if kind not in item.emitted]

    def _item_event(self, item: _Item, kind: str) -> Event:
        """One opening or closing event of `item`."""
        if kind in (_ADDED, _DONE):
            fields: dict[str, Any] = {"output_index": item.output_index, "item": item.to_dict()}
        elif kind == "response.function_call_arguments.done":
            fields = {"item_id": item.id, "output_index": item.output_index, "arguments": item.content}
        elif kind == "response.output_text.done":
            fields = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
            fields.update(text=item.content, logprobs=[])
        else:
            part = _text_part("" if kind == _PART_ADDED else item.content)
            fields = {"item_id": item.id, "output_index": item.output_index, "content_index": 0, "part": part}
        item.emitted.add(kind)
        return self._emit(kind, **fields)

    def _failed(self) -> list[Event]:
        code, message = self._error  # type: ignore[misc]
        for item in self._items:
            if _DONE not in item.emitted:
                item.status = "incomplete"
        self._open = None
        self._response["status"] = "failed"
        self._response["error"] = {"code": code if code in OPENAI_ERROR_CODES else "server_error", "message": message}
        return [self._terminal("response.failed")]

    def _terminal(self, kind: str) -> Event:
        self._final = self.response
        return self._emit(kind, response=copy.deepcopy(self._final))
