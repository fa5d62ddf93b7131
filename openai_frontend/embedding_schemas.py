"""POST /v1/embeddings: its pydantic request (OpenAI's fields) and its typed response.

`input` takes OpenAI's four shapes: a string, a list of strings, a list of token ids (one prompt), a list
of lists of token ids. Unknown fields are a 400 that names them, as in every request (schemas.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator

from openai_frontend.errors import InvalidRequest
from openai_frontend.responses import OpenAIBaseModel
from openai_frontend.schemas import FAIL_FAST, Strings, TokenIds, _Request
from protocol.sampling import MAX_TOKEN_ID

EmbeddingInput = str | Strings | TokenIds | Annotated[list[TokenIds], FAIL_FAST]


class EmbeddingRequest(_Request):
    model: str
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own size: its vectors cannot be shortened
    user: str | None = None  # accepted, as OpenAI's (it names the end user; nothing depends on it)

    @field_validator("input", mode="wrap")
    @classmethod
    def _token_ids_as_they_are(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of integers is one prompt of token ids, taken as it is (the union's other members would
        first make an error per item); anything else is validated as the union."""
        if type(value) is list and value and all(type(item) is int for item in value):
            return value
        return handler(value)

    @field_validator("input")
    @classmethod
    def _token_ids_bounded(cls, value: EmbeddingInput) -> EmbeddingInput:
        """Token ids the wire can carry (the engine checks its vocabulary)."""
        if isinstance(value, str) or not value:
            return value
        if isinstance(value[0], int):
            _require_token_ids(value)  # type: ignore[arg-type]
            return value
        for prompt in value:
            if isinstance(prompt, list):
                _require_token_ids(prompt)
        return value


def _require_token_ids(ids: list[int]) -> None:
    """(Raised as InvalidRequest, which pydantic does not wrap, so `param` is the user's field.)"""
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidRequest(f"input holds {bad}, which is not a token id (an integer in [0, {MAX_TOKEN_ID}])", "input")


class EmbeddingData(OpenAIBaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of the little-endian float32 bytes


class EmbeddingUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData] = Field(default_factory=list)
    usage: EmbeddingUsage
