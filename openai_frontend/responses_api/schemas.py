"""The request body of POST /v1/responses (OpenAI's Responses API, plus vLLM's extra sampling fields).

The body is checked as the chat schemas check theirs: the same JSON walk first (`_Request`), `extra="forbid"` at the
top level and in tools and `text`, so an unknown field is a 400 that names it. Inside input items unknown fields are
ignored, as inside chat messages: clients send back output items with fields of OpenAI's that say nothing to this
model (phase, annotations, logprobs, caller, ...). What this server cannot do (images, files, audio, built-in tools,
conversations, prompt templates, logprobs) is a 400 that names the field and says so, never silently dropped.

Input items are parsed here rather than by a pydantic union, so that an error names the item's own path
(`input.1.content.0.type`), not the union member pydantic tried.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from openai_frontend.errors import InvalidRequest
from openai_frontend.schemas import (
    FAIL_FAST,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    FunctionDefinition,
    LogitBias,
    StopStrings,
    StopTokenIds,
    _Request,
    _Strict,
    openai_metadata,
)

_M = TypeVar("_M", bound=BaseModel)
Status = Literal["in_progress", "completed", "incomplete"]
_TEXT_PARTS = frozenset(("input_text", "output_text"))
# What `include` may ask for: output this server never produces (so there is nothing to include), or the
# encrypted reasoning of a model that does not reason. Logprobs of the output text it does produce are refused.
_INCLUDABLE = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    """A text part of a message: `input_text` as clients write it, `output_text` as the model wrote it."""

    type: Literal["input_text", "output_text"]
    text: str


Content = str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS, fail_fast=True)]


class MessageItem(_Item):
    """A message: OpenAI's easy input message (no type, string content) or a message item."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None
    status: Status | None = None


class FunctionCallItem(_Item):
    """A call the model made, as clients send it back with its result."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it
    id: str | None = None
    status: Status | None = None


class FunctionCallOutputItem(_Item):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: Status | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_TYPES: dict[str, type[InputItem]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


class FunctionTool(FunctionDefinition):
    """A function tool, its fields at the top level as the Responses API writes them (chat nests them)."""

    type: Literal["function"]


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_fields_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema":
            for name, value in (("name", self.name), ("schema", self.schema_)):
                if value is None:
                    raise InvalidRequest(f"text.format of type json_schema needs {name}", f"text.format.{name}")
            return self
        given = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        field = next((n for n, v in given.items() if v is not None), None)
        if field is not None:
            raise InvalidRequest(
                f"text.format.{field} is only read with type json_schema (got type {self.type})", f"text.format.{field}"
            )
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint to OpenAI's models; accepted, not used


class Reasoning(_Strict):
    """Accepted for clients that always send it, and not used: this model does not reason (vLLM's rule)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Request):
    """POST /v1/responses. `seed` may be None here: the service chooses one so that a resumed run samples the
    same tokens (docs/responses.md)."""

    model: str
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS, fail_fast=True)] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)  # bounds built-in tool calls, of which there are none
    store: bool = True
    background: bool = False
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    truncation: Literal["disabled", "auto"] | None = None  # auto: the prompt's last tokens are kept (vLLM's rule)
    include: Annotated[list[_INCLUDABLE], FAIL_FAST] | None = None
    reasoning: Reasoning | None = None
    # OpenAI fields that change nothing this server produces, accepted as chat accepts them.
    metadata: Annotated[dict[str, str], FAIL_FAST] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = None
    # OpenAI features this server does not have: a field given is a 400 that says so.
    conversation: Any = None
    prompt: Any = None
    # vLLM's extra sampling fields (those of chat's SamplingFields that a Responses client sends).
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    logit_bias: LogitBias | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @field_validator("store", "background", mode="before")
    @classmethod
    def _null_is_the_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI reads null as the field left out."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if len(value) > MAX_MESSAGES:
            raise InvalidRequest(f"input holds at most {MAX_MESSAGES} items (got {len(value)})", "input")
        return parse_items(value, "input")

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise InvalidRequest(
                    f"tools.{i}.type: built-in tools ({kind}) are not supported; only function tools are",
                    f"tools.{i}.type",
                )
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_supported(cls, value: Any) -> Any:
        if isinstance(value, dict):
            if value.get("type") != "function":
                raise InvalidRequest(
                    f'tool_choice of type {value.get("type")!r} is not supported: give "auto", "none", '
                    '"required" or {"type": "function", "name": ...}',
                    "tool_choice.type",
                )
            return _validated(FunctionToolChoice, value, "tool_choice")
        if isinstance(value, str) and value not in ("auto", "none", "required"):
            raise InvalidRequest(
                f'tool_choice {value!r} is not supported: give "auto", "none", "required" or a function',
                "tool_choice",
            )
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise InvalidRequest("top_logprobs are not supported (give 0 or leave it out)", "top_logprobs")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        for i, name in enumerate(value or ()):
            if name == "message.output_text.logprobs":
                raise InvalidRequest("logprobs of the output text are not supported by this server", f"include.{i}")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _not_supported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            hint = "; chain responses with previous_response_id" if info.field_name == "conversation" else ""
            raise InvalidRequest(f"{info.field_name} is not supported by this server{hint}", info.field_name)
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_within_openai_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return openai_metadata(value)

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise InvalidRequest("background responses must be stored: background needs store true", "background")
        return self


def parse_items(value: list[Any], where: str) -> list[InputItem]:
    """Input items (as a client sends them, or as stored) -> typed items; InvalidRequest names the first bad field
    from `where` on (`input.1.content.0.type`)."""
    return [_item(raw, f"{where}.{i}") for i, raw in enumerate(value)]


def _item(raw: Any, path: str) -> InputItem:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{path} must be an object (an input item)", path)
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if model is None:
        if kind is None:
            raise InvalidRequest(f"{path} needs a type (or a role, for a message)", f"{path}.type")
        hint = "; chain responses with previous_response_id" if kind == "item_reference" else ""
        raise InvalidRequest(f"{path}.type: input items of type {kind!r} are not supported{hint}", f"{path}.type")
    content_field = "output" if model is FunctionCallOutputItem else "content"
    _check_parts(raw.get(content_field), f"{path}.{content_field}")
    return _validated(model, raw, path)


def _validated(model: type[_M], raw: dict[str, Any], path: str) -> _M:
    """`raw` as a `model`; InvalidRequest names the bad field from `path` on."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        where, message = field_error(e, path)
        raise InvalidRequest(f"{where}: {message}", where) from None


def field_error(e: ValidationError, path: str = "") -> tuple[str, str]:
    """The field path (from `path` on) and message of `e`'s error that names the deepest field: of a union (text or
    parts) the member that got furthest, the one the client meant. The union members pydantic names in the location
    (`list[TextPart]`, `str`) are left out."""
    error = max(e.errors(), key=lambda error: len(error["loc"]))
    loc = [str(x) for x in error["loc"] if not _is_union_member(x)]
    return ".".join([path, *loc] if path else loc), error["msg"]


def _check_parts(parts: Any, path: str) -> None:
    """A part that is not text is refused by name: this model reads text only."""
    for i, part in enumerate(parts if isinstance(parts, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in _TEXT_PARTS:
            raise InvalidRequest(
                f"{path}.{i}.type: content parts of type {kind!r} are not supported (this model reads text only)",
                f"{path}.{i}.type",
            )


def _is_union_member(part: object) -> bool:
    """Pydantic names the union member it tried in an error's location (`list[TextPart]`, `str`)."""
    return isinstance(part, str) and ("[" in part or part == "str")
