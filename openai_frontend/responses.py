"""The OpenAI response bodies this server sends, as pydantic models (the shapes of vLLM's protocol.py).

Each endpoint has a stream chunk (`*StreamResponse`, one choice per engine step of one sequence) and a
response (`*Response`: those chunks merged, merge.py). A field typed `| MISSING` is left out of the JSON
while it is MISSING; a field that is None is sent as null. So each body has exactly the keys the
endpoint promises, in the order declared here.

Stream models are frozen: a chunk is sent as built. Payloads our own code builds per token (logprobs,
vLLM's prompt_logprobs) skip validation. `json_text` and `json_body` encode the models with the stdlib
encoder, which walks those payloads once, in C; the models' fields go to it as they are (no aliases or
custom serializers here), so the JSON holds what `model_dump()` holds.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import MISSING, BaseModel, ConfigDict, SkipValidation
from typing_extensions import TypedDict

from openai_frontend.generation import Usage

Finish = Literal["stop", "length", "abort", "tool_calls"]
StopReason = str | int | None  # vLLM's: the stop string or stop token id that ended the choice
VllmPromptLogprobs = list[dict[str, dict[str, Any]] | None]  # vLLM's: per prompt token, {token id: entry}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _StreamModel(OpenAIBaseModel):
    model_config = ConfigDict(frozen=True)


class PromptTokensDetails(_StreamModel):
    cached_tokens: int  # prompt tokens served from the engine's prefix cache


class UsageInfo(_StreamModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | MISSING = MISSING  # OpenAI's: on every usage `of` builds

    @classmethod
    def of(cls, usage: Usage) -> UsageInfo:
        return cls(**usage.to_dict())


# -- logprobs (their entries are built by logprobs.py) -----------------------------------------------


class CompletionLogProbs(OpenAIBaseModel):
    """OpenAI's legacy completions logprobs: one entry per token in each list."""

    tokens: SkipValidation[list[str]]
    token_logprobs: SkipValidation[list[float | None]]  # None: an echoed prompt's first token
    top_logprobs: SkipValidation[list[dict[str, float] | None]]
    text_offset: SkipValidation[list[int]]

    def extend(self, more: CompletionLogProbs) -> None:
        self.tokens.extend(more.tokens)
        self.token_logprobs.extend(more.token_logprobs)
        self.top_logprobs.extend(more.top_logprobs)
        self.text_offset.extend(more.text_offset)


class ChatCompletionLogProb(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb]


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: SkipValidation[list[ChatCompletionLogProbsContent]]

    def extend(self, more: ChatCompletionLogProbs) -> None:
        self.content.extend(more.content)


# -- what every body starts with -------------------------------------------------------------------


class _Envelope(OpenAIBaseModel):
    id: str
    object: str
    created: int
    model: str


# -- completions -----------------------------------------------------------------------------------


class CompletionResponseStreamChoice(_StreamModel):
    index: int  # prompt_index * n + seq_index
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: Finish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | MISSING = MISSING  # vLLM's return_token_ids: on every chunk
    prompt_token_ids: list[int] | MISSING = MISSING  # and on a choice's first chunk
    prompt_logprobs: SkipValidation[VllmPromptLogprobs | None | MISSING] = MISSING  # a choice's first chunk


class CompletionStreamResponse(_Envelope, _StreamModel):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None | MISSING = MISSING  # null before the last chunk with include_usage (OpenAI's)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: Finish | None
    stop_reason: StopReason
    # vLLM's: null unless asked for (a non-streamed response carries them all; a chunk only those it has)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: SkipValidation[VllmPromptLogprobs | None] = None
    token_ids: list[int] | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None


# -- chat completions ------------------------------------------------------------------------------


class DeltaFunctionCall(_StreamModel):
    name: str | MISSING = MISSING  # on a call's first delta (its header), with arguments ""
    arguments: str


class DeltaToolCall(_StreamModel):
    index: int
    id: str | MISSING = MISSING  # id and type: on the header
    type: Literal["function"] | MISSING = MISSING
    function: DeltaFunctionCall


class DeltaMessage(_StreamModel):
    role: Literal["assistant"] | MISSING = MISSING  # on a choice's first chunk
    content: str | MISSING = MISSING
    tool_calls: list[DeltaToolCall] | MISSING = MISSING


class ChatCompletionResponseStreamChoice(_StreamModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: Finish | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | MISSING = MISSING


class ChatCompletionStreamResponse(_Envelope, _StreamModel):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None | MISSING = MISSING  # null before the last chunk with include_usage (OpenAI's)
    prompt_token_ids: list[int] | MISSING = MISSING  # vLLM's response-level fields: on the first chunk
    prompt_logprobs: SkipValidation[VllmPromptLogprobs | None | MISSING] = MISSING


class FunctionCall(OpenAIBaseModel):
    name: str | None
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str | None
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["assistant"]
    content: str | None  # None: a message of tool calls only (OpenAI's rule)
    tool_calls: list[ToolCall] | MISSING = MISSING


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None
    finish_reason: Finish | None
    stop_reason: StopReason
    token_ids: list[int] | None = None  # vLLM's: null unless asked for


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None
    prompt_token_ids: list[int] | None = None  # vLLM's: null unless asked for
    prompt_logprobs: SkipValidation[VllmPromptLogprobs | None] = None


# -- JSON ------------------------------------------------------------------------------------------


def _fields(obj: object) -> dict[str, Any]:
    """The encoder's hook for a model: its fields in declared order (pydantic keeps them in `__dict__`),
    those that are MISSING left out; nested models come back through this hook."""
    if isinstance(obj, OpenAIBaseModel):
        return {name: value for name, value in obj.__dict__.items() if value is not MISSING}
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


_sse_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=_fields)
_body_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_fields)


def json_text(data: OpenAIBaseModel | dict[str, Any]) -> str:
    """An SSE event's JSON: a chunk, or an error's dict."""
    return _sse_encoder.encode(data)


def json_body(data: OpenAIBaseModel) -> bytes:
    """A non-streamed body's JSON, encoded as Starlette's JSONResponse encodes a dict."""
    return _body_encoder.encode(data).encode("utf-8")
