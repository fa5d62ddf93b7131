"""A Responses request as the chat request that generates it, its input items as stored and listed, and the
response object before any output.

A response is generated as one chat completion: `instructions` first, as a system message, then the conversation of
`previous_response_id` (each earlier response's input items, then its output items, oldest first), then this
request's input. Planning, the template, tools and constraints are then chat's own (ChatService.plan), so both APIs
render the same prompt for the same conversation.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from openai_frontend.errors import InvalidRequest
from openai_frontend.responses_api.schemas import (
    Content,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ResponsesRequest,
    field_error,
    parse_items,
)
from openai_frontend.schemas import MAX_MESSAGES, ChatCompletionRequest

# OpenAI's id prefixes of the listed item types.
_ID_PREFIX = {MessageItem: "msg_", FunctionCallItem: "fc_", FunctionCallOutputItem: "fco_"}
# Chat request fields the Responses request calls otherwise (errors ChatService and the engine raise name them).
_CHAT_FIELDS = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "truncate_prompt_tokens": "truncation",
    "logprobs": "top_logprobs",
    "chat_template_kwargs": "input",
}
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


def listed_input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input as GET /v1/responses/{id}/input_items lists it (OpenAI's ResponseItem shapes): each item
    with an id (the client's where it gave one), a status, and a message's content as parts."""
    return [_listed(item) for item in _input(req)]


def chat_request(req: ResponsesRequest, history: Sequence[dict[str, Any]], seed: int | None) -> ChatCompletionRequest:
    """The chat request that generates this response. `history`: the earlier turns of the previous_response_id
    chain, oldest first, as stored (each response's listed input items, then its output items). `seed`: the one to
    sample with (the client's, or the one the service chose). Not streamed: the service streams the run itself."""
    items = [*parse_items(list(history), "previous_response_id"), *_input(req)]
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    messages += _chat_messages(items)
    if not messages:
        raise InvalidRequest("input holds no items, and there are no instructions or earlier turns to answer", "input")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(
            f"the conversation (instructions, earlier turns and input) makes {len(messages)} chat messages, "
            f"more than {MAX_MESSAGES}",
            "input",
        )
    data: dict[str, Any] = {name: getattr(req, name) for name in _SAMPLING_FIELDS}
    data |= {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "seed": seed,
        "stream": False,
        "tools": [_chat_tool(t.model_dump(exclude={"type"}, exclude_none=True)) for t in req.tools or ()] or None,
        "tool_choice": _chat_tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req),
        "truncate_prompt_tokens": -1 if req.truncation == "auto" else None,
    }
    try:
        return ChatCompletionRequest.model_validate(data)
    except InvalidRequest as e:
        raise InvalidRequest(e.message, chat_param(e.param), e.code) from None
    except ValidationError as e:
        where, message = field_error(e)
        param = chat_param(where)
        raise InvalidRequest(f"{param}: {message}", param) from None


def chat_param(param: str | None) -> str | None:
    """A chat request's field path as the Responses request calls it. A message's path is `input`: its index in
    the chat request counts the instructions and the earlier turns, so it names no item of this input."""
    if param is None:
        return None
    parts = param.split(".")
    head = parts[0]
    if head == "messages":
        return "input"
    if head == "response_format":
        rest = parts[2:] if parts[1:2] == ["json_schema"] else parts[1:]
        return ".".join(["text", "format", *rest])
    if head == "tools" and parts[2:3] == ["function"]:
        return ".".join(parts[:2] + parts[3:])
    if head == "tool_choice" and parts[1:2] == ["function"]:
        return ".".join(["tool_choice", *parts[2:]])
    return _CHAT_FIELDS.get(param, param)


def response_object(req: ResponsesRequest, response_id: str, created_at: int, status: str) -> dict[str, Any]:
    """The response object (OpenAI's Response) before any output, its request's settings as OpenAI reports them:
    the defaults filled in, `reasoning` empty (this model does not reason), one service tier."""
    text_format = req.text.format if req.text is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": req.background,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {
            "format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else {"type": "text"},
            "verbosity": req.text.verbosity if req.text is not None and req.text.verbosity else "medium",
        },
        "tool_choice": _listed_tool_choice(req),
        "tools": [t.model_dump() for t in req.tools or ()],
        "top_logprobs": 0,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _input(req: ResponsesRequest) -> list[InputItem]:
    return req.input if isinstance(req.input, list) else [MessageItem(role="user", content=req.input)]


def _listed(item: InputItem) -> dict[str, Any]:
    common = {"id": item.id or _ID_PREFIX[type(item)] + uuid.uuid4().hex, "type": item.type}
    status = item.status or "completed"
    if isinstance(item, FunctionCallItem):
        return common | {"call_id": item.call_id, "name": item.name, "arguments": item.arguments, "status": status}
    if isinstance(item, FunctionCallOutputItem):
        output = item.output if isinstance(item.output, str) else _parts(item.output, "input_text")
        return common | {"call_id": item.call_id, "output": output, "status": status}
    kind = "output_text" if item.role == "assistant" else "input_text"  # the SDK's output / input message
    return common | {"role": item.role, "content": _parts(item.content, kind), "status": status}


def _parts(content: Content, kind: str) -> list[dict[str, Any]]:
    texts = [content] if isinstance(content, str) else [part.text for part in content]
    extra = {"annotations": []} if kind == "output_text" else {}
    return [{"type": kind, "text": text, **extra} for text in texts]


def _chat_messages(items: Sequence[InputItem]) -> list[dict[str, Any]]:
    """Items -> chat messages: the calls of one model turn, and the text it wrote just before them, are one
    assistant message, as a chat template expects a turn."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
        else:
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _chat_content(item.content)})
    return messages


def _chat_content(content: Content) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": part.text} for part in content]


def _chat_tool(function: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": function}


def _chat_tool_choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    """OpenAI reads "auto" without tools as no tools (chat refuses it)."""
    choice = req.tool_choice
    if choice is None or (choice == "auto" and not req.tools):
        return None
    if isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _listed_tool_choice(req: ResponsesRequest) -> str | dict[str, Any]:
    choice = req.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    text_format = req.text.format if req.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    schema = text_format.model_dump(by_alias=True, exclude={"type"}, exclude_none=True)
    return {"type": "json_schema", "json_schema": schema}
