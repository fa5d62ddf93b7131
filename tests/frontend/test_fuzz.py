"""Fuzzing the frontend with schemathesis: requests drawn from the app's own OpenAPI schema, valid and
invalid, against the real FastAPI app over a FakeEngineClient (in-process ASGI, no sockets). No value of
any field may be a 5xx: a bad value is the client's error, and its answer a 4xx naming the field.

Two routes read a raw JSON object and pick their schema from its keys (/tokenize, /invocations), so
their OpenAPI body says only "an object"; the test gives them the schemas they dispatch to, and names
the one served model in `model`, so that most requests get past the model lookup to the work behind it.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from openai_frontend.app import create_app
from openai_frontend.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from protocol import SamplingParams
from tests.fake_engine import FAKE_MODEL, FakeEngineClient
from tests.frontend.test_scoring import scoring_script

MODEL = dataclasses.replace(FAKE_MODEL, tokenizer_source="smollm2")  # the tokenizer endpoints and echo need one
COMPONENTS = "#/components/schemas/{model}"
# Routes whose body FastAPI sees as a bare object: the request schemas they dispatch to.
DISPATCHED_BODIES: dict[str, tuple[type[BaseModel], ...]] = {
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/invocations": (ChatCompletionRequest, CompletionRequest),
}


def fuzzed_schema(openapi: dict[str, Any]) -> dict[str, Any]:
    """The app's OpenAPI document with the dispatched bodies spelled out and `model` the served one."""
    doc = copy.deepcopy(openapi)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, models in DISPATCHED_BODIES.items():
        refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=COMPONENTS)
        for name, definition in defs.get("$defs", {}).items():
            components.setdefault(name, definition)
        body = {"anyOf": [refs[(m, "validation")] for m in models]}
        doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"] = body
    for definition in components.values():
        model = definition.get("properties", {}).get("model")
        if model is not None:
            optional = {"type": "null"} in model.get("anyOf", ())
            named = {"const": MODEL.name}
            definition["properties"]["model"] = {"anyOf": [named, {"type": "null"}]} if optional else named
    # A rule the schema cannot state: only an assistant message with tool_calls may leave out content.
    message = components["ChatMessage"]
    message["required"] = [*message.get("required", []), "content"]
    content = message["properties"]["content"]
    content["anyOf"] = [kind for kind in content["anyOf"] if kind.get("type") != "null"]
    return doc


def short_script(prompt: str | list[int], params: SamplingParams) -> list[Any]:
    """A few tokens whatever max_tokens asks for (the fake engine would make every one of them)."""
    return scoring_script(prompt, dataclasses.replace(params, max_tokens=min(params.max_tokens or 3, 3), min_tokens=0))


def _app() -> Any:
    return create_app(FakeEngineClient(short_script, models=(MODEL,)))


APP = _app()
SCHEMA = schemathesis.openapi.from_dict(fuzzed_schema(APP.openapi()))
SCHEMA.app = APP


@pytest.fixture(autouse=True, scope="module")
def _unfrozen_after() -> Iterator[None]:
    """schemathesis runs the app's lifespan, which freezes the collector's view of every object then alive:
    thawed for the tests that run after these."""
    yield
    gc.unfreeze()


def no_server_error(case: schemathesis.Case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, (
        f"{case.method} {case.path} {case.body!r} -> {response.status_code}: {response.text}"
    )


# The same requests every run: a failure is a finding to fix, not a draw. The routes with a body get
# most of the examples (the work behind them is where a value can go wrong); the whole file runs in
# well under a minute on two cores.
def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


@pytest.mark.slow
@SCHEMA.include(method="POST").parametrize()
@fuzz(examples=120)
def test_no_body_is_a_server_error(case: schemathesis.Case) -> None:
    no_server_error(case)


@pytest.mark.slow
@SCHEMA.exclude(method="POST").parametrize()
@fuzz(examples=20)
def test_no_query_or_path_is_a_server_error(case: schemathesis.Case) -> None:
    no_server_error(case)
