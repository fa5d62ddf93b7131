"""What a client may send and what it gets past a bound: each size has a limit, each token id is checked
before it is cast, and no number or string of any field is a 5xx. Each refusal is a 400 whose `param`
names the field and whose message names the limit or the value."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openai_frontend import schemas
from openai_frontend.errors import InvalidRequest
from openai_frontend.settings import Settings, parse_settings
from openai_frontend.triton_client import build_request
from protocol import InvalidRequestError, SamplingParams
from tests.fake_engine import FakeEngineClient
from tests.frontend.test_api import make_client
from tests.frontend.test_scoring import MODEL, engine

USER = [{"role": "user", "content": "hi"}]


async def send(path: str, body: dict[str, Any] | bytes, eng: FakeEngineClient | None = None) -> tuple[int, Any]:
    # Sent as JSON text of our own: ASCII-escaped, so a lone surrogate travels as JSON can carry it, and
    # raw bytes for what only Python's parser reads (NaN, Infinity).
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with make_client(eng or engine()) as client:
        r = await client.post(path, content=content, headers={"content-type": "application/json"})
    return r.status_code, r.json()


async def refused(path: str, body: dict[str, Any] | bytes, param: str, *words: str) -> None:
    status, out = await send(path, body)
    assert status == 400, out
    assert out["error"]["param"] == param, out
    for word in words:
        assert word in out["error"]["message"], out


# -- sizes ---------------------------------------------------------------------------------------


async def test_prompts_per_completions_request_are_bounded() -> None:
    limit = Settings().max_prompts_per_request
    eng = engine()
    status, _ = await send("/v1/completions", {"model": MODEL, "prompt": ["x"] * limit, "max_tokens": 1}, eng)
    assert status == 200 and len(eng.calls) == limit
    for prompt in (["x"] * (limit + 1), [[5]] * (limit + 1)):
        await refused("/v1/completions", {"model": MODEL, "prompt": prompt}, "prompt", str(limit))


async def test_the_prompt_bound_is_a_flag() -> None:
    settings = parse_settings(["--max-prompts-per-request", "3"])
    assert settings.max_prompts_per_request == 3
    with pytest.raises(ValueError):
        Settings(max_prompts_per_request=0)
    eng = engine()
    async with make_client(eng, settings) as client:
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["a"] * 3, "max_tokens": 1})
        over = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[5]] * 4, "max_tokens": 1})
    assert ok.status_code == 200 and len(eng.calls) == 3
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    assert over.json()["error"]["message"] == "prompt holds at most 3 prompts (got 4)"


async def test_one_long_token_id_prompt_is_one_prompt() -> None:
    long_prompt = [5] * (Settings().max_prompts_per_request + 1)
    status, _ = await send("/v1/completions", {"model": MODEL, "prompt": long_prompt})
    assert status == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_messages_are_bounded(path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": USER * schemas.MAX_MESSAGES}
    assert (await send(path, body))[0] == 200
    body["messages"] = USER * (schemas.MAX_MESSAGES + 1)
    await refused(path, body, "messages", str(schemas.MAX_MESSAGES))


async def test_content_parts_are_bounded() -> None:
    parts = [{"type": "text", "text": "a"}] * (schemas.MAX_CONTENT_PARTS + 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    await refused("/v1/chat/completions", body, "messages.0.content", str(schemas.MAX_CONTENT_PARTS))


async def test_tool_calls_of_a_message_are_bounded() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "tool_calls": [call] * (schemas.MAX_TOOL_CALLS + 1)}]
    body = {"model": MODEL, "messages": messages}
    await refused("/v1/chat/completions", body, "messages.1.tool_calls", str(schemas.MAX_TOOL_CALLS))


async def test_tools_are_bounded() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    body = {"model": MODEL, "messages": USER, "tools": [tool] * (schemas.MAX_TOOLS + 1)}
    await refused("/v1/chat/completions", body, "tools", str(schemas.MAX_TOOLS))


async def test_a_tools_parameters_schema_is_bounded() -> None:
    def tool(description_chars: int) -> dict[str, Any]:
        parameters = {"type": "object", "description": "d" * description_chars}
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    fits = schemas.MAX_TOOL_PARAMETERS_CHARS - len('{"type":"object","description":""}')
    assert (await send("/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": [tool(fits)]}))[0] == 200
    body = {"model": MODEL, "messages": USER, "tools": [tool(fits + 1)]}
    await refused("/v1/chat/completions", body, "tools.0.function.parameters", str(schemas.MAX_TOOL_PARAMETERS_CHARS))


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_nesting_is_bounded_before_anything_walks_the_body() -> None:
    # The body is depth 0, chat_template_kwargs 1, its value 2: the list levels start at 2.
    inside = schemas.MAX_JSON_DEPTH - 2
    ok = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"x": nested(inside)}}
    assert (await send("/v1/chat/completions", ok))[0] == 200
    too_deep = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"x": nested(inside + 1)}}
    await refused("/v1/chat/completions", too_deep, "chat_template_kwargs.x" + ".0" * inside, "nests")


async def test_nesting_deep_enough_to_exhaust_the_stack_is_a_400() -> None:
    # Deep enough that a recursive walk of it runs out of stack, shallow enough for Python's parser.
    deep = b"[" * 950 + b"]" * 950
    body = b'{"model":"fake-llm","messages":[{"role":"user","content":"x"}],"chat_template_kwargs":{"x":' + deep + b"}}"
    status, _ = await send("/v1/chat/completions", body)
    assert status == 400
    await refused("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": deep.decode()}, "guided_json")


# -- token ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("token_id", [-1, 2**31, 2**32 + 5, 2**64])
@pytest.mark.parametrize("shape", ["one", "several"])
async def test_prompt_token_ids_outside_int32_are_refused_before_any_cast(token_id: int, shape: str) -> None:
    prompt: list[Any] = [1, token_id] if shape == "one" else [[1], [2, token_id]]
    eng = engine()
    status, out = await send("/v1/completions", {"model": MODEL, "prompt": prompt, "echo": True}, eng)
    assert status == 400 and out["error"]["param"] == "prompt" and str(token_id) in out["error"]["message"]
    assert eng.calls == []


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids"])
async def test_sampling_token_ids_name_the_id(field: str) -> None:
    await refused("/v1/completions", {"model": MODEL, "prompt": "x", field: [3, 2**32 + 5]}, field, str(2**32 + 5))


@pytest.mark.parametrize("key", [str(2**32 + 5), str(2**64)])
async def test_logit_bias_ids_name_the_id(key: str) -> None:
    await refused("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {key: 1}}, "logit_bias", key)


@pytest.mark.parametrize("key", ["-5", " 5", "5_0", "\u0665", "5.0", ""])
async def test_logit_bias_keys_are_decimal_token_ids(key: str) -> None:
    await refused("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {key: 1}}, "logit_bias", repr(key))


@pytest.mark.parametrize("prompt", [[2**32 + 5], [2**64], [-1]])
def test_build_request_refuses_what_int32_cannot_hold(prompt: list[int]) -> None:
    with pytest.raises(InvalidRequest) as refusal:
        build_request("llm", prompt, SamplingParams(), "r")
    assert refusal.value.param == "prompt"


def test_sampling_params_name_the_id_that_is_not_one() -> None:
    with pytest.raises(InvalidRequestError) as refusal:
        SamplingParams.from_dict({"stop_token_ids": [1, -7]})
    assert refusal.value.param == "stop_token_ids" and "-7" in refusal.value.message


# -- numbers and text no field may turn into a 5xx -------------------------------------------------

RAW_COMPLETION = b'{"model":"fake-llm","prompt":"x",%s}'


@pytest.mark.parametrize(
    "field_json, param",
    [
        (b'"temperature":NaN', "temperature"),
        (b'"top_p":Infinity', "top_p"),
        (b'"temperature":1e999', "temperature"),
        (b'"logit_bias":{"5":-Infinity}', "logit_bias"),
        (b'"guided_json":{"type":"number","maximum":Infinity}', "guided_json"),
        (b'"guided_json":"{\\"type\\":\\"number\\",\\"minimum\\":NaN}"', "guided_json"),
        (
            b'"response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"enum":[NaN]}}}',
            "response_format.json_schema.schema",
        ),
        (b'"seed":%d' % 2**64, "seed"),
        (b'"n":%d' % 10**20, "n"),
        (b'"max_tokens":-1', "max_tokens"),
        (b'"min_tokens":%d' % 10**30, "min_tokens"),
        (b'"truncate_prompt_tokens":%d' % 10**30, "truncate_prompt_tokens"),
        (b'"logprobs":%d' % 10**30, "logprobs"),
        (b'"model":"\\ud800"', "model"),
    ],
)
async def test_extreme_values_are_400s_naming_the_field(field_json: bytes, param: str) -> None:
    await refused("/v1/completions", RAW_COMPLETION % field_json, param)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        ("/detokenize", {"model": "\ud800", "tokens": [1]}, "model"),
        ("/detokenize", {"tokens": [2**64]}, "tokens"),
    ],
)
async def test_tokenizer_endpoints_refuse_what_they_cannot_read(path: str, body: dict[str, Any], param: str) -> None:
    await refused(path, body, param)


async def test_a_list_that_starts_with_a_number_is_still_walked() -> None:
    body = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"x": [1, "\ud800"]}}
    await refused("/v1/chat/completions", body, "chat_template_kwargs.x.1", "surrogate")
    deep = {"model": MODEL, "messages": USER, "chat_template_kwargs": {"x": [1, nested(schemas.MAX_JSON_DEPTH)]}}
    assert (await send("/v1/chat/completions", deep))[0] == 400
