"""The response models: their JSON (null vs left-out fields, key order, what model_dump holds) and the
merge of streamed chunks into one non-streamed response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from openai_frontend.merge import merge_chat, merge_completion
from openai_frontend.responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    OpenAIBaseModel,
    UsageInfo,
    json_body,
    json_text,
)

ENVELOPE = {"id": "cmpl-1", "created": 7, "model": "m"}
USAGE = UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5)


def completion_chunk(*choices: CompletionResponseStreamChoice, **fields: Any) -> CompletionStreamResponse:
    return CompletionStreamResponse(**ENVELOPE, choices=list(choices), **fields)


def chat_chunk(*choices: ChatCompletionResponseStreamChoice, **fields: Any) -> ChatCompletionStreamResponse:
    return ChatCompletionStreamResponse(**{**ENVELOPE, "id": "chatcmpl-1"}, choices=list(choices), **fields)


def lp(*tokens: str) -> CompletionLogProbs:
    return CompletionLogProbs(
        tokens=list(tokens),
        token_logprobs=[-0.5] * len(tokens),
        top_logprobs=[{t: -0.5} for t in tokens],
        text_offset=list(range(len(tokens))),
    )


async def chunks_of(*chunks: Any) -> AsyncIterator[Any]:
    for chunk in chunks:
        yield chunk


def test_missing_fields_are_left_out_and_none_fields_are_null():
    chunk = completion_chunk(CompletionResponseStreamChoice(index=0, text="hi"))
    assert json_text(chunk) == (
        '{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
        '[{"index":0,"text":"hi","logprobs":null,"finish_reason":null,"stop_reason":null}]}'
    )
    chunk = chat_chunk(
        ChatCompletionResponseStreamChoice(index=1, delta=DeltaMessage(role="assistant", content="")),
        usage=USAGE,
        prompt_logprobs=None,
    )
    assert json_text(chunk) == (
        '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m","choices":'
        '[{"index":1,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null,'
        '"stop_reason":null}],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
        '"prompt_logprobs":null}'
    )


@pytest.mark.parametrize(
    "model",
    [
        completion_chunk(
            CompletionResponseStreamChoice(
                index=2, text="é\n", logprobs=lp("a"), finish_reason="stop", stop_reason=42, token_ids=[5]
            ),
            usage=USAGE,
        ),
        chat_chunk(
            ChatCompletionResponseStreamChoice(
                index=0,
                delta=DeltaMessage(
                    tool_calls=[
                        DeltaToolCall(
                            index=0, id="call_1", type="function", function=DeltaFunctionCall(name="f", arguments="")
                        )
                    ]
                ),
                logprobs=ChatCompletionLogProbs(
                    content=[{"token": "x", "logprob": -1.2e-07, "bytes": [120], "top_logprobs": []}]
                ),
            ),
            prompt_token_ids=[1, 2],
        ),
        CompletionResponse(**ENVELOPE, choices=[], usage=None),
    ],
)
def test_the_json_is_what_model_dump_holds_in_the_declared_order(model: OpenAIBaseModel):
    dumped = model.model_dump()
    assert json_text(model) == json.dumps(dumped, ensure_ascii=False, separators=(",", ":"))
    assert json_body(model) == json_text(model).encode()


def test_json_refuses_what_is_neither_json_nor_a_model():
    with pytest.raises(TypeError, match="set"):
        json_text({"x": {1}})


async def test_completion_merge_joins_text_logprobs_and_token_ids_per_choice():
    merged = await merge_completion(
        chunks_of(
            completion_chunk(
                CompletionResponseStreamChoice(
                    index=1, text="b", logprobs=lp("b"), token_ids=[2], prompt_token_ids=[9], prompt_logprobs=None
                )
            ),
            completion_chunk(CompletionResponseStreamChoice(index=0, text="a", logprobs=lp("a"), token_ids=[1])),
            completion_chunk(
                CompletionResponseStreamChoice(
                    index=1, text="c", logprobs=lp("c"), finish_reason="stop", stop_reason="END", token_ids=[3]
                )
            ),
            completion_chunk(usage=USAGE),
        )
    )
    assert merged.usage == USAGE
    first, second = merged.choices
    assert (first.index, first.text, first.token_ids, first.prompt_token_ids) == (0, "a", [1], None)
    assert (second.text, second.token_ids, second.prompt_token_ids) == ("bc", [2, 3], [9])
    assert second.logprobs.tokens == ["b", "c"] and second.logprobs.text_offset == [0, 0]
    assert (second.finish_reason, second.stop_reason, second.prompt_logprobs) == ("stop", "END", None)
    assert list(second.model_dump()) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "prompt_token_ids",
        "prompt_logprobs",
        "token_ids",
    ]


async def test_chat_merge_folds_tool_call_deltas_and_a_calls_only_message_has_no_content():
    def call_delta(index: int, **fields: Any) -> ChatCompletionResponseStreamChoice:
        return ChatCompletionResponseStreamChoice(
            index=0, delta=DeltaMessage(tool_calls=[DeltaToolCall(index=index, **fields)])
        )

    merged = await merge_chat(
        chunks_of(
            chat_chunk(
                ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant", content="")),
                prompt_token_ids=[4, 5],
            ),
            chat_chunk(call_delta(0, id="call_a", type="function", function=DeltaFunctionCall(name="f", arguments=""))),
            chat_chunk(call_delta(0, function=DeltaFunctionCall(arguments='{"x": '))),
            chat_chunk(call_delta(0, function=DeltaFunctionCall(arguments="1}"))),
            chat_chunk(ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(), finish_reason="tool_calls")),
        )
    )
    (choice,) = merged.choices
    assert merged.first.prompt_token_ids == [4, 5] and merged.usage is None
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_dump() == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    }
