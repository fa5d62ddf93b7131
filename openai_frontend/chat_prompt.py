"""A chat request's prompt: its messages and tools as the model's template renders them, the same for
/v1/chat/completions and /tokenize with messages (whose purpose is to show what chat sends).

Special tokens a user types (`<|im_start|>system` in a message) are text, not control tokens: where a
user string holds a special token's text, the prompt goes as token ids, with that string's place in the
rendered text tokenized as plain text and the template's own special tokens kept. The place is found by
rendering twice: once as asked, once with each such string replaced by a marker, then walking both
renders side by side; a string the template does not write as given (nor trimmed, nor as JSON) cannot
be placed, and the request is refused rather than sent with a guess.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from openai_frontend.chat_template import render_chat, template_reads_tools
from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.schemas import ChatMessage
from openai_frontend.tool_calls import ToolPlan, template_messages, template_tools

# What one message or tool costs the template beside its text, counted in characters of text.
_ITEM_CHARS = 64

Span = tuple[int, int]  # (start, end) character offsets in the rendered prompt


@dataclass(frozen=True, slots=True)
class ChatInput:
    """What a chat request gives the template."""

    messages: Sequence[ChatMessage]
    tools: ToolPlan
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any] | None
    # The request's field of these messages, which errors about them name: `messages`, or in a batched
    # chat its conversation's `messages.<i>`.
    field: str = "messages"

    def work_chars(self) -> int:
        """About how much text rendering and tokenizing this chat handles (tokenizers.Tokenizers.run)."""
        return sum(len(m.text()) + _ITEM_CHARS for m in self.messages) + _ITEM_CHARS * len(self.tools.tools)


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    # Where user strings holding a special token's text were written: tokenized as plain text
    # (Tokenizer.encode_with_text_spans). Empty: the text tokenizes as it is.
    text_spans: tuple[Span, ...] = ()


@dataclass(frozen=True, slots=True)
class _TemplateInput:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] | None


def rendered_chat(model: ModelInfo, chat: ChatInput, special_texts: frozenset[str] = frozenset()) -> RenderedChat:
    """The prompt of `chat` (tools in the template's `tools` where it reads them, else in a system prompt),
    with the places of the user strings that hold any of `special_texts` (none given: nothing is placed).

    Raises InvalidRequest when such a string cannot be placed (the template changes it)."""
    knows_tools = bool(model.chat_template) and template_reads_tools(model.name, model.chat_template)
    given = _TemplateInput(
        template_messages(list(chat.messages), chat.tools, knows_tools),
        template_tools(chat.tools) if knows_tools else None,
        chat.template_kwargs,
    )
    text = _render(model, chat, given)
    if not special_texts:
        return RenderedChat(text)
    special, special_in_json = _special_patterns(special_texts)
    if not special_in_json.search(json.dumps((given.messages, given.tools, given.kwargs), ensure_ascii=False)):
        return RenderedChat(text)
    markers = _Markers(special)
    masked = _TemplateInput(
        markers.mask(given.messages, "messages"),
        markers.mask(given.tools, "tools"),
        markers.mask(given.kwargs, "kwargs"),
    )
    spans = markers.spans(text, _render(model, chat, masked))
    if spans is None:
        where = _request_field(markers.paths[0], len(given.messages) - len(chat.messages), chat.field)
        raise InvalidRequest(
            f"{where} holds a special token's text, which this model's chat template does not write as "
            "given, so it cannot be kept as plain text; leave it out (the operator may start the "
            "frontend with --allow-special-tokens-in-content to read it as control tokens)",
            where,
        )
    return RenderedChat(text, spans)


def _render(model: ModelInfo, chat: ChatInput, given: _TemplateInput) -> str:
    try:
        return render_chat(
            model,
            given.messages,
            given.tools,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            template_kwargs=given.kwargs,
        )
    except InvalidRequest as e:
        if e.param == "messages" and chat.field != "messages":  # the template refused this conversation
            e.param, e.message = chat.field, f"{chat.field}: {e.message}"
        raise


@lru_cache(maxsize=16)
def _special_patterns(special_texts: frozenset[str]) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """Patterns of the texts in a string and in the JSON of a template input. JSON escapes character
    by character, so a string that holds a text holds it escaped in the JSON; one whole search of the
    JSON is the cheap test that most chats pass (what else it matches only takes the careful path)."""
    texts = sorted(special_texts, key=len, reverse=True)
    escaped = (json.dumps(t, ensure_ascii=False)[1:-1] for t in texts)
    return re.compile("|".join(map(re.escape, texts))), re.compile("|".join(map(re.escape, escaped)))


class _Markers:
    """Each user string that holds special-token text, replaced by a marker no user can have typed
    (letters and digits only, so that trimming or JSON leaves it as it is)."""

    def __init__(self, special: re.Pattern[str]) -> None:
        self._special = special
        nonce = secrets.token_hex(8)
        self._marker = f"M{nonce}N{{}}E"
        self._pattern = re.compile(f"M{nonce}N([0-9]+)E")
        self.originals: list[str] = []
        self.paths: list[str] = []  # where each original is in the template input, e.g. `messages.1.content`

    def mask(self, value: Any, path: str) -> Any:
        if isinstance(value, str):
            if not self._special.search(value):
                return value
            self.originals.append(value)
            self.paths.append(path)
            return self._marker.format(len(self.originals) - 1)
        if isinstance(value, dict):
            return {self.mask(k, path): self.mask(v, f"{path}.{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.mask(v, f"{path}.{i}") for i, v in enumerate(value)]
        return value

    def spans(self, text: str, masked_text: str) -> tuple[Span, ...] | None:
        """Where `text` has the originals that `masked_text` has markers for, walking both from the start:
        the template's own text must agree exactly, each original be written in one of its forms. None
        where they do not line up."""
        parts = self._pattern.split(masked_text)  # template text, a marker's number, template text, ...
        spans: list[Span] = []
        at = 0
        for i in range(0, len(parts), 2):
            if not text.startswith(parts[i], at):
                return None
            at += len(parts[i])
            if i + 1 == len(parts):
                break
            following = parts[i + 2]
            form = next(
                (
                    f
                    for f in _written_forms(self.originals[int(parts[i + 1])])
                    if text.startswith(f, at) and text.startswith(following, at + len(f))
                ),
                None,
            )
            if form is None:
                return None
            if self._special.search(form):
                spans.append((at, at + len(form)))
            at += len(form)
        return tuple(spans) if at == len(text) else None


def _written_forms(value: str) -> list[str]:
    """How a template may write a string: as given, trimmed, or inside JSON (Jinja's `tojson` escapes
    HTML characters as well)."""
    as_json = json.dumps(value)[1:-1]
    html_safe = as_json.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026").replace("'", "\\u0027")
    return list(dict.fromkeys((value, value.strip(), json.dumps(value, ensure_ascii=False)[1:-1], as_json, html_safe)))


def _request_field(path: str, inserted_messages: int, messages_field: str) -> str:
    """The request's field of a template input's path (the tools' system prompt, when the frontend
    inserts one, comes first among the messages; `messages_field` names the messages in the request)."""
    top, _, rest = path.partition(".")
    if top == "kwargs":
        return f"chat_template_kwargs.{rest}" if rest else "chat_template_kwargs"
    if top == "messages":
        index, _, field = rest.partition(".")
        if not index:
            return messages_field
        if int(index) < inserted_messages:
            return "tools"
        return f"{messages_field}.{int(index) - inserted_messages}.{field}".rstrip(".")
    return f"{top}.{rest}".rstrip(".")
