"""A non-streamed response's content: the chunks its stream would send, merged.

One loop (`_merge`) reads the chunks; per endpoint a fold adds one stream choice to its response
choice. So streamed and non-streamed responses have the same text, tool calls, tokens and logprobs
by construction. The merge owns the chunks it reads: a choice's first logprobs and token ids are
extended in place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import MISSING

from openai_frontend.responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionLogProbs,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)

C = TypeVar("C")  # a response choice
L = TypeVar("L", CompletionLogProbs, ChatCompletionLogProbs)


@dataclass(slots=True)
class Merged(Generic[C]):
    choices: list[C]  # by index
    usage: UsageInfo | None  # the last that a chunk carried
    first: Any  # the first chunk (chat's response-level fields travel on it), None where there was none


async def merge_completion(chunks: AsyncIterator[CompletionStreamResponse]) -> Merged[CompletionResponseChoice]:
    return await _merge(chunks, _fold_completion)


async def merge_chat(chunks: AsyncIterator[ChatCompletionStreamResponse]) -> Merged[ChatCompletionResponseChoice]:
    merged = await _merge(chunks, _fold_chat)
    for choice in merged.choices:
        if choice.message.tool_calls and not choice.message.content:
            choice.message.content = None  # OpenAI: a message of calls only has no content
    return merged


async def _merge(chunks: AsyncIterator[Any], fold: Callable[[Any, Any], C]) -> Merged[C]:
    choices: dict[int, C] = {}
    first = usage = None
    async with aclosing(chunks):
        async for chunk in chunks:
            if first is None:
                first = chunk
            if isinstance(chunk.usage, UsageInfo):
                usage = chunk.usage
            for c in chunk.choices:
                choices[c.index] = fold(choices.get(c.index), c)
    return Merged(choices=[choices[i] for i in sorted(choices)], usage=usage, first=first)


def _fold_completion(
    acc: CompletionResponseChoice | None, c: CompletionResponseStreamChoice
) -> CompletionResponseChoice:
    if acc is None:
        acc = CompletionResponseChoice(index=c.index, text="", logprobs=None, finish_reason=None, stop_reason=None)
    acc.text += c.text
    acc.logprobs = _joined(acc.logprobs, c.logprobs)
    acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    acc.prompt_token_ids = given(c.prompt_token_ids, acc.prompt_token_ids)
    acc.prompt_logprobs = given(c.prompt_logprobs, acc.prompt_logprobs)
    acc.token_ids = _joined_ids(acc.token_ids, c.token_ids)
    return acc


def _fold_chat(
    acc: ChatCompletionResponseChoice | None, c: ChatCompletionResponseStreamChoice
) -> ChatCompletionResponseChoice:
    if acc is None:
        message = ChatMessage(role="assistant", content="")
        acc = ChatCompletionResponseChoice(
            index=c.index, message=message, logprobs=None, finish_reason=None, stop_reason=None
        )
    delta, message = c.delta, acc.message
    if delta.content is not MISSING:
        message.content += delta.content
    if delta.tool_calls is not MISSING:
        if message.tool_calls is MISSING:
            message.tool_calls = []
        for call in delta.tool_calls:
            _fold_tool_call(message.tool_calls, call)
    acc.logprobs = _joined(acc.logprobs, c.logprobs)
    # A choice's role chunk comes before all its others, so its last chunk's finish is the choice's.
    acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    acc.token_ids = _joined_ids(acc.token_ids, c.token_ids)
    return acc


def _fold_tool_call(calls: list[ToolCall], delta: DeltaToolCall) -> None:
    """Fold one streamed tool-call delta into the message's calls (header first, then arguments)."""
    while len(calls) <= delta.index:
        calls.append(ToolCall(id=None, type="function", function=FunctionCall(name=None, arguments="")))
    call = calls[delta.index]
    if delta.id is not MISSING:
        call.id, call.type = delta.id, delta.type
    if delta.function.name is not MISSING:
        call.function.name = delta.function.name
    call.function.arguments += delta.function.arguments


def _joined(acc: L | None, more: L | None) -> L | None:
    if acc is None:
        return more
    if more is not None:
        acc.extend(more)
    return acc


def given(value: Any, otherwise: Any = None) -> Any:
    """A chunk's field where the chunk has it, else `otherwise` (a response's vLLM fields are null when unset)."""
    return otherwise if value is MISSING else value


def _joined_ids(acc: list[int] | None, more: list[int] | MISSING) -> list[int] | None:
    if more is MISSING:
        return acc
    if acc is None:
        return more
    acc.extend(more)
    return acc
