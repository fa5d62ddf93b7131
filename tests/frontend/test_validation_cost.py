"""A body of a million bad items costs one error, not a million: every list and map a client fills stops
its validation at the first bad item (pydantic's fail_fast), or refuses the length first. Validation runs
in one call that holds the GIL, so a million errors (seconds, and their memory) would stall the event loop
and every stream on it. Checked field by field on every request schema, with the error count (no timing)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from openai_frontend import schemas
from openai_frontend.embedding_schemas import EmbeddingRequest
from openai_frontend.errors import FrontendError
from openai_frontend.responses_api.schemas import ResponsesRequest

MANY = 20_000
MOST_ERRORS = 8  # a union reports one error per member it tried
USER = [{"role": "user", "content": "hi"}]
BASES: dict[type[BaseModel], dict[str, Any]] = {
    schemas.CompletionRequest: {"model": "m", "prompt": "x"},
    schemas.ChatCompletionRequest: {"model": "m", "messages": USER},
    EmbeddingRequest: {"model": "m", "input": "x"},
    ResponsesRequest: {"model": "m", "input": "x"},
    schemas.TokenizeCompletionRequest: {"model": "m", "prompt": "x"},
    schemas.TokenizeChatRequest: {"model": "m", "messages": USER},
    schemas.DetokenizeRequest: {"model": "m", "tokens": [1]},
}
FLOODS = {
    "nulls": [None] * MANY,
    "lists": [[None]] * MANY,
    "map of nulls": {f"k{i}": None for i in range(MANY)},
}


def errors(model: type[BaseModel], body: dict[str, Any]) -> int:
    try:
        model.model_validate(body)
    except ValidationError as e:
        return e.error_count()
    except (ValueError, FrontendError):  # a validator's own refusal: one error
        return 1
    return 0


@pytest.mark.parametrize("model", list(BASES), ids=lambda m: m.__name__)
@pytest.mark.parametrize("flood", list(FLOODS))
def test_no_top_level_field_makes_an_error_per_item(model: type[BaseModel], flood: str) -> None:
    bad = {
        name: n
        for name in model.model_fields
        if (n := errors(model, {**BASES[model], name: FLOODS[flood]})) > MOST_ERRORS
    }
    assert not bad, f"fields that make an error per item: {bad}"


@pytest.mark.parametrize(
    "model,body",
    [
        (schemas.ChatCompletionRequest, {"messages": [{"role": "user", "content": [None] * MANY}]}),
        (schemas.ChatCompletionRequest, {"messages": [[None] * MANY]}),
        (schemas.ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [None] * MANY}]}),
        (schemas.ChatCompletionRequest, {"messages": USER, "tools": [None] * MANY}),
        (schemas.CompletionRequest, {"prompt": [[None] * MANY]}),
        (schemas.CompletionRequest, {"prompt": [[1, None] * MANY]}),
        (schemas.CompletionRequest, {"prompt": ["x", *[None] * MANY]}),
        (ResponsesRequest, {"input": [{"role": "user", "content": [None] * MANY}]}),
        (ResponsesRequest, {"input": [None] * MANY}),
    ],
)
def test_nested_lists_stop_at_the_first_bad_item(model: type[BaseModel], body: dict[str, Any]) -> None:
    assert errors(model, {"model": "m", **body}) <= MOST_ERRORS
