"""Structured outputs and tool calls end to end: openai client / raw HTTP -> frontend -> tritonserver ->
engine with xgrammar. The model is SmolLM2-135M at temperature 1.0: only enforcement makes every
output valid."""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.triton_stream import check_invariants, stream_generate

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a city."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Room for the longest output these schemas allow (bounded strings, and free JSON whitespace is capped at 16
# characters per place), so a sampled output is never cut short: finish_reason must be "stop".
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=300)


def json_schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_at_temperature_1_with_n2_always_validates(client, servers):
    def one(i):
        r = client.chat.completions.create(
            model=servers.model,
            messages=ASK_PERSON,
            n=2,
            temperature=1.0,
            max_tokens=MAX_TOKENS,
            seed=i,
            response_format=json_schema_format(PERSON),
        )
        return [(c.message.content, c.finish_reason) for c in r.choices]

    with ThreadPoolExecutor(4) as pool:
        results = [out for outs in pool.map(one, range(20)) for out in outs]
    assert len(results) == 40
    for content, finish in results:
        assert finish == "stop", content
        jsonschema.validate(json.loads(content), PERSON)
    assert len({content for content, _ in results}) > 1  # sampled, not one fixed answer


def test_regex_choice_grammar_and_json_object(client, servers):
    regex = r"\d{3}-\d{4}"
    r = client.completions.create(
        model=servers.model,
        prompt="Call me at",
        max_tokens=20,
        n=3,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in r.choices), r.choices
    choices = ["yes", "no", "it depends"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = client.chat.completions.create(
            model=servers.model,
            messages=[{"role": "user", "content": "Is it raining?"}],
            n=4,
            temperature=1.0,
            max_tokens=10,
            extra_body=body,
        )
        assert all(c.message.content in choices for c in r.choices), r.choices
    grammar = 'root ::= "SELECT " column " FROM " table\ncolumn ::= "id" | "name"\ntable ::= "users" | "orders"'
    r = client.completions.create(
        model=servers.model,
        prompt="SQL:",
        max_tokens=30,
        temperature=1.0,
        n=2,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert all(re.fullmatch(r"SELECT (id|name) FROM (users|orders)", c.text) for c in r.choices), r.choices
    r = client.chat.completions.create(
        model=servers.model,
        messages=ASK_PERSON,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_streamed_constrained_output_equals_the_non_streamed(client, servers):
    kwargs = dict(
        model=servers.model,
        messages=ASK_PERSON,
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        response_format=json_schema_format(PERSON),
    )
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs) if c.choices
    )
    assert streamed == full
    jsonschema.validate(json.loads(full), PERSON)


@pytest.mark.parametrize(
    "tool_choice, finish",
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_forced_tool_calls_always_validate_and_stream_identically(client, servers, tool_choice, finish):
    params = WEATHER["function"]["parameters"]
    # One call per choice (parallel calls off), so MAX_TOKENS always holds it: every choice must end with a valid call.
    r = client.chat.completions.create(
        model=servers.model,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice=tool_choice,
        n=4,
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        seed=7,
        parallel_tool_calls=False,
    )
    for choice in r.choices:
        assert choice.finish_reason == finish and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params)

    kwargs = dict(
        model=servers.model,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0.0,
        max_tokens=80,
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    last_finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.id is not None:
                    assert call["name"] is None  # header once, before any argument fragment
                    call["name"] = d.function.name
                else:
                    assert call["name"] is not None
                call["arguments"] += d.function.arguments or ""
            last_finish = choice.finish_reason or last_finish
    assert last_finish == finish
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls
    ]


def test_auto_tool_calls_are_parsed_and_follow_up_turns_work(client, servers):
    # The 135M model seldom calls tools on its own; a regex makes it write a call in SmolLM2's format
    # so that the auto parser runs on real engine output, streamed and not.
    tagged = r'<tool_call>\[\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}\]</tool_call>'  # noqa: E501
    kwargs = dict(
        model=servers.model,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice="auto",
        temperature=0.0,
        max_tokens=60,
        extra_body={"structured_outputs": {"regex": tagged}},
    )
    full = client.chat.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content is None
    (call,) = full.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "celsius"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    arguments = "".join(
        d.function.arguments or "" for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ()
    )
    assert arguments == call.function.arguments
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]

    follow_up = ASK_WEATHER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
        {"role": "developer", "content": "Answer in one sentence."},
    ]
    r = client.chat.completions.create(
        model=servers.model, messages=follow_up, tools=[WEATHER], temperature=0.0, max_tokens=30
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "structured_outputs.grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)
def test_invalid_constraints_are_400s(servers, body, param):
    for stream in (False, True):
        r = httpx.post(
            f"{servers.base_url}/chat/completions",
            timeout=60,
            json={"model": servers.model, "messages": ASK_WEATHER, "stream": stream, **body},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_constrained_and_free_requests_mixed_at_concurrency_8(client, servers):
    def constrained(i):
        r = client.chat.completions.create(
            model=servers.model,
            messages=ASK_PERSON,
            temperature=1.0,
            seed=100 + i,
            max_tokens=MAX_TOKENS,
            response_format=json_schema_format(PERSON),
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        for chunk in r:
            usage = chunk.usage or usage
            text += "".join(c.delta.content or "" for c in chunk.choices)
        jsonschema.validate(json.loads(text), PERSON)
        return usage.completion_tokens

    def free(i):
        r = client.completions.create(
            model=servers.model,
            prompt=f"Story {i}:",
            temperature=1.0,
            seed=i,
            max_tokens=24,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        return sum(1 for chunk in r for c in chunk.choices if c.text is not None)

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(constrained if i % 2 else free, i) for i in range(16)]
        results = [f.result() for f in futures]
    assert all(r > 0 for r in results)
    # and at the Triton level, the step contract of a constrained n=3 request
    result = asyncio.run(
        stream_generate(
            servers.triton.grpc_url,
            servers.model,
            "Phone:",
            {
                "n": 3,
                "max_tokens": 20,
                "temperature": 1.0,
                "logprobs": 1,
                "structured_outputs": {"regex": r"\d{3}-\d{4}"},
            },
        )
    )
    check_invariants(result, n=3, logprobs=1)
    for responses in result.by_seq().values():
        assert re.fullmatch(r"\d{3}-\d{4}", "".join(r.text_delta for r in responses))


# grammar_compile_timeout_s in the model repository's config.pbtxt.
COMPILE_BUDGET_S = 5.0
# Within every limit, yet each long repetition of a broad class compiles for a second or two: twelve take
# several times the budget (and keep one of the engine's compile threads busy after it).
SLOW_GRAMMAR = "root ::= " + " ".join(f'[^{c}]{{1,2000}} "{c}"' for c in "abcdefghijkl")


def test_grammar_work_is_bounded_and_a_small_constraint_never_waits_behind_a_big_one(servers):
    def post(path, body):
        started = time.monotonic()
        r = httpx.post(f"{servers.base_url}{path}", timeout=120, json={"model": servers.model, **body})
        return r, time.monotonic() - started

    def complete(constraint, stream=False):
        body = {"prompt": "Code:", "max_tokens": 10, "stream": stream, "structured_outputs": constraint}
        return post("/completions", body)

    huge_enum = json_schema_format({"enum": [f"value-{i}" for i in range(40_000)]})
    r, took = post("/chat/completions", {"messages": ASK_PERSON, "max_tokens": 8, "response_format": huge_enum})
    assert r.status_code == 400 and took < 5, (took, r.text)  # over a limit: refused before it is parsed
    error = r.json()["error"]
    assert error["param"] == "response_format.json_schema.schema" and "5000" in error["message"], error

    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(complete, {"grammar": SLOW_GRAMMAR})
        time.sleep(1.0)  # its compile is under way
        small, small_took = complete({"regex": "[0-9]{2}-[a-f]{2}"})
        r, took = big.result()
    assert small.status_code == 200 and re.fullmatch("[0-9]{2}-[a-f]{2}", small.json()["choices"][0]["text"])
    assert small_took < 3.5, small_took  # not behind the big one, which ends no sooner than 4 s after it
    assert r.status_code == 400 and took < COMPILE_BUDGET_S + 10, (took, r.text)
    error = r.json()["error"]
    assert error["param"] == "structured_outputs.grammar", error
    assert "too complex to compile in time" in error["message"], error

    r, took = complete({"grammar": SLOW_GRAMMAR}, stream=True)  # the same again: refused at once, remembered
    assert r.status_code == 400 and took < 5, (took, r.text)
    assert "too complex to compile in time" in r.json()["error"]["message"]
