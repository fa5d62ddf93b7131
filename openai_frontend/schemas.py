"""Pydantic request schemas of the OpenAI API subset we serve.

`extra="forbid"` everywhere but inside chat messages: an unknown or unsupported field (functions,
suffix, ...) is a 400 that names it, never silently ignored. Inside a message unknown fields are
ignored (vLLM's rule), because clients send back OpenAI's own response fields there. Range checks of
sampling values live in protocol.SamplingParams (one place); the schemas check types and the
OpenAI-only rules, and bound what the frontend itself pays for before the engine sees a request.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from openai_frontend.errors import InvalidRequest
from protocol.sampling import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
)

# Sizes a client chooses and the frontend pays for (validating, rendering the chat template, one engine
# request per prompt): OpenAI's bound where it has one (tools, tool_calls), elsewhere one no real request
# nears. Past a bound the request is a 400 naming the field (docs/security.md). The sampling lists'
# bounds are protocol.SamplingParams'.
MAX_MESSAGES = 4096  # in one conversation
MAX_BATCH_MESSAGES = 65536  # in all the conversations of a batched chat together
MAX_CONTENT_PARTS = 1024  # parts of one message's content
MAX_TOOLS = 128
MAX_TOOL_CALLS = 128  # calls in one assistant message
MAX_TOOL_PARAMETERS_CHARS = 32768  # a tool's parameters schema, as compact JSON
MAX_JSON_DEPTH = 128  # levels of nesting anywhere in a body
_TOKEN_ID_LISTS = ("prompt", "tokens", "stop_token_ids", "allowed_token_ids")
_TEXT_OR_CONTAINER = frozenset((str, dict, list))  # the types json.loads makes that _check_json walks


# A token id as the OpenAPI document states it: the range is checked where the ids are read (the prompt's
# below, the sampling lists' in protocol.SamplingParams, the vocabulary by the engine and /detokenize).
TokenId = Annotated[int, WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID})]

# Every list and map a client fills is validated fail-fast: it stops at its first bad item. Validation is
# one call that holds the GIL, so a body of a million nulls would otherwise make a million errors (seconds
# of the event loop's thread, and their memory) before the 400 (tests/frontend/test_validation_cost.py).
FAIL_FAST = Field(fail_fast=True)
Strings = Annotated[list[str], FAIL_FAST]
TokenIds = Annotated[list[TokenId], FAIL_FAST]
# The sampling lists at protocol.SamplingParams' bounds, refused by their length before any item is read.
StopStrings = Annotated[list[str], Field(max_length=MAX_STOP_STRINGS, fail_fast=True)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS, fail_fast=True)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS, fail_fast=True)]


class _Strict(BaseModel):
    """Unknown fields are an error: the first one, not one per unknown key (a map of a million keys would
    otherwise make a million errors, see FAIL_FAST)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="wrap")
    @classmethod
    def _first_unknown_only(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            known = cls._known_keys()
            unknown = next((k for k in data if k not in known), None)
            if unknown is not None:
                data = {k: v for k, v in data.items() if k in known or k == unknown}
        return handler(data)

    @classmethod
    def _known_keys(cls) -> frozenset[str]:
        return frozenset(name for n, f in cls.model_fields.items() for name in (n, f.alias) if name is not None)


class _Request(_Strict):
    """A request body. Before its fields are read, the body is walked once: JSON may carry a lone UTF-16
    surrogate ("\\ud800"), which no UTF-8 text can hold, and nesting that Python's parser reads but
    later walks (validation, encoding a schema, a template's tojson) would run out of stack on. Either
    is a 400 here rather than a 500 there. (Raised as InvalidRequest, which pydantic does not wrap, so
    `param` is the field's path, not a union member's.)"""

    @model_validator(mode="before")
    @classmethod
    def _well_formed(cls, data: Any) -> Any:
        _check_json(data, "", 0)
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsField(_Strict):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Strings | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class SamplingFields(_Request):
    """Fields shared by completions and chat completions (OpenAI's, plus vLLM's extra sampling ones)."""

    model: str
    n: int | None = None  # None (JSON null) means 1, as in OpenAI's API
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: LogitBias | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ALLOWED_TOKEN_IDS, fail_fast=True)] | None = (
        None  # vLLM's: only these tokens are sampled
    )
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS, fail_fast=True)] | None = None  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the context window)
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # None: True
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, not used
    # Output constraints (openai_frontend/constraints.py): OpenAI's response_format, vLLM's
    # structured_outputs, and the older guided_* spellings clients still send. At most one.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Strings | None = None
    guided_grammar: str | None = None
    # vLLM's: scores of the prompt's tokens (not with stream), token ids in the response, tokens named by id.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's beam search: n beams, the n best returned, not streamed (backend/beam_search.py).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None

    @model_validator(mode="after")
    def _not_streamed(self) -> SamplingFields:
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.use_beam_search and self.stream:
            raise InvalidRequest("use_beam_search is not available when stream is true", "use_beam_search")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """Keys in decimal digits only: int() would also read " 5", "5_0" and other scripts' digits."""
        bad = next((k for k in value or () if not (k.isascii() and k.isdigit())), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias key {bad!r} is not a token id (a decimal integer)", "logit_bias")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | Strings | TokenIds | Annotated[list[TokenIds], FAIL_FAST]
    max_tokens: int | None = None  # 0 only with echo: the prompt is scored, nothing generated
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = None

    # (Before _prompts_bounded, which so runs after it.)
    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_as_they_are(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of integers is one prompt of token ids, taken as it is: the union's other members would
        first make an error per item, in one call that holds the GIL. Anything else is validated as the
        union, with the union's errors."""
        if type(value) is list and value and all(type(item) is int for item in value):
            return value
        return handler(value)

    @field_validator("prompt")
    @classmethod
    def _prompts_bounded(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        """Token ids the wire can carry (the engine checks its vocabulary): an id past INT32 would otherwise
        wrap where the frontend casts it. (How many prompts is the service's bound: --max-prompts-per-request.)"""
        if isinstance(value, str) or not value:
            return value
        if isinstance(value[0], int):
            _require_prompt_token_ids(value)  # one prompt of token ids
            return value
        for prompt in value:
            if isinstance(prompt, list):
                _require_prompt_token_ids(prompt)
        return value


class TextPart(_Strict):
    type: Literal["text"]
    text: str


TextParts = Annotated[list[TextPart], FAIL_FAST]


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """An assistant message's call of a tool (sent back by clients in follow-up turns)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Unknown fields inside a message are ignored, as vLLM does: clients send assistant messages back
    # with fields of OpenAI's responses (refusal, annotations, audio, reasoning_content, ...).
    model_config = ConfigDict(extra="ignore")

    # OpenAI's roles, and any other a chat template knows (vLLM passes custom roles on to the template).
    role: str = Field(min_length=1)
    # an assistant's, at most OpenAI's bound (before content: content's check reads it)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS, fail_fast=True)
    content: str | TextParts | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None  # tool

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_assistant(cls, value: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if value and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return value

    @field_validator("content")
    @classmethod
    def _has_content(cls, value: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        return _parts_bounded(value)

    def text(self) -> str:
        """Text parts are joined with a newline, as vLLM does."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _parameters_bounded(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":"))) if value is not None else 0
        if size > MAX_TOOL_PARAMETERS_CHARS:
            raise ValueError(
                f"a tool's parameters schema holds at most {MAX_TOOL_PARAMETERS_CHARS} characters as JSON (got {size})"
            )
        return value


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


# OpenAI's bounds: an empty list is a 400 there (and in vLLM), as is a 129th tool.
Tools = Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS, fail_fast=True)]
Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]


def _messages_kind(value: Any) -> str:
    """Which form chat's `messages` takes: a list of lists is a batch of conversations. The tags are the
    names pydantic gives union members, which an error's `param` leaves out (app.py), so that
    `messages.1.0.content` is conversation 1's first message."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "list[list[ChatMessage]]"
    return "list[ChatMessage]"


# vLLM's batched chat: several conversations, one engine request each. How many is the service's bound
# (--max-prompts-per-request); all their messages together are bounded here, before any is validated.
Conversations = Annotated[list[Messages], Field(min_length=1, fail_fast=True)]
ChatMessages = Annotated[
    Annotated[Messages, Tag("list[ChatMessage]")] | Annotated[Conversations, Tag("list[list[ChatMessage]]")],
    Discriminator(_messages_kind),
]


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class Prediction(_Strict):
    type: Literal["content"]
    content: str | TextParts

    @field_validator("content")
    @classmethod
    def _content_bounded(cls, value: str | list[TextPart]) -> str | list[TextPart]:
        return _parts_bounded(value)


class ChatCompletionRequest(SamplingFields):
    messages: ChatMessages  # one conversation, or a batch of them (vLLM's batched chat)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template controls.
    echo: bool | None = None  # the last message, if it is the assistant's, starts each choice's content
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the model continues the last message instead of starting a new one
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    # OpenAI parameters that change nothing this server produces, accepted (as OpenAI and vLLM accept
    # them) so that clients which set them are served: nothing is stored, as there is no endpoint that
    # reads a completion back; there is one service tier; the prefix cache needs no key; a predicted
    # output only shortens OpenAI's latency, never changes the output.
    store: bool | None = None
    metadata: Annotated[dict[str, str], FAIL_FAST] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    safety_identifier: str | None = None  # `user`'s successor
    prediction: Prediction | None = None
    modalities: Strings | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _batch_bounded(cls, value: Any) -> Any:
        if _messages_kind(value) == "list[list[ChatMessage]]":
            total = sum(len(c) for c in value if isinstance(c, list))
            if total > MAX_BATCH_MESSAGES:
                raise InvalidRequest(
                    f"messages holds at most {MAX_BATCH_MESSAGES} messages in all its conversations (got {total})",
                    "messages",
                )
        return value

    @property
    def batched(self) -> bool:
        """Whether `messages` is a batch of conversations (each its own engine request and choice)."""
        return bool(self.messages) and isinstance(self.messages[0], list)

    def conversations(self) -> list[list[ChatMessage]]:
        """The conversations: `messages` itself, or its one conversation."""
        return self.messages if self.batched else [self.messages]  # type: ignore[list-item,return-value]

    @field_validator("metadata")
    @classmethod
    def _metadata_within_openai_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return openai_metadata(value)

    @field_validator("modalities")
    @classmethod
    def _text_output_only(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(m != "text" for m in value):
            raise InvalidRequest('this model only writes text: modalities may hold only "text"', "modalities")
        return value

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(set add_generation_prompt to false)",
                "continue_final_message",
            )
        return self


class TokenizeCompletionRequest(_Request):
    """vLLM's POST /tokenize with a prompt."""

    model: str | None = None  # None: the one model served
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """vLLM's POST /tokenize with chat messages: the prompt the chat template renders."""

    model: str | None = None
    messages: Messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Tools | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds


def openai_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's bounds of `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512."""
    if value is not None and (
        len(value) > 16 or any(len(k) > 64 for k in value) or any(len(v) > 512 for v in value.values())
    ):
        raise InvalidRequest(
            "metadata holds at most 16 pairs, keys of at most 64 characters and values of at most 512", "metadata"
        )
    return value


def _parts_bounded(content: str | list[TextPart] | None) -> str | list[TextPart] | None:
    if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
        raise ValueError(f"content holds at most {MAX_CONTENT_PARTS} parts (got {len(content)})")
    return content


def _require_prompt_token_ids(ids: list[int]) -> None:
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidRequest(
            f"prompt holds {bad}, which is not a token id (an integer in [0, {MAX_TOKEN_ID}])", "prompt"
        )


def _check_json(value: Any, path: str, depth: int) -> None:
    """Raises InvalidRequest naming the field (e.g. `messages.0.content`) of the first string UTF-8 cannot
    hold, or of a value nested deeper than MAX_JSON_DEPTH."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{path or 'body'} is not valid Unicode text: it holds a lone surrogate (\\ud800-\\udfff)",
                path or None,
            ) from None
        return
    if not isinstance(value, (dict, list)):
        return
    if depth >= MAX_JSON_DEPTH:
        raise InvalidRequest(f"{path} nests more than {MAX_JSON_DEPTH} levels deep", path)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, path, depth)
            _check_json(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif not _holds_token_ids(value, path):
        for i, item in enumerate(value):
            if type(item) in _TEXT_OR_CONTAINER:  # (a number needs no check, nor a path built)
                _check_json(item, f"{path}.{i}", depth + 1)


def _holds_token_ids(value: list[Any], path: str) -> bool:
    """A list of token ids needs no walk: validation refuses anything in it but integers."""
    field, _, index = path.partition(".")
    listed = field in _TOKEN_ID_LISTS and (not index or (field == "prompt" and index.isdigit()))
    return listed and bool(value) and type(value[0]) is int
