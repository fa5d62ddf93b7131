"""The frontend's output constraints and tool calls against a FakeEngineClient: which constraint
reaches the engine, how errors name the user's field, how tool calls are rendered into the prompt and
read back from the output, streamed and not (the two must agree exactly)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openai_frontend.errors import InvalidRequest
from openai_frontend.tool_calls import ToolCallStream, ToolPlan, parse_tagged_calls
from protocol import StructuredOutputs, schema_text
from tests.fake_engine import FakeEngineClient, scripted_steps
from tests.frontend.test_api import MODEL, by_choice, make_client, stream

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b", "a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def replying(*texts: list[str], finish: str = "stop"):
    """A script whose sequence i emits the token texts texts[i] (each sequence, n of them)."""

    def script(prompt, params):
        return scripted_steps([texts[i % len(texts)] for i in range(params.n)], finish)

    return script


async def post(engine: FakeEngineClient, path: str, body: dict[str, Any]):
    async with make_client(engine) as client:
        return await client.post(path, json={"model": MODEL, **body})


@pytest.mark.parametrize(
    "path, body, expected",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            StructuredOutputs(json=schema_text(SCHEMA, "p")),
        ),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
        ("/v1/chat/completions", {"response_format": {"type": "text"}}, None),
        ("/v1/completions", {"structured_outputs": {"regex": r"\d+"}}, StructuredOutputs(regex=r"\d+")),
        (
            "/v1/completions",
            {"structured_outputs": {"json": json.dumps(SCHEMA), "disable_any_whitespace": True}},
            StructuredOutputs(json=schema_text(SCHEMA, "p"), disable_any_whitespace=True),
        ),
        ("/v1/completions", {"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputs(choice=("a", "b"))),
        (
            "/v1/completions",
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutputs(grammar='root ::= "a"'),
        ),
        ("/v1/completions", {"guided_json": SCHEMA}, StructuredOutputs(json=schema_text(SCHEMA, "p"))),
        ("/v1/completions", {"guided_regex": "a+"}, StructuredOutputs(regex="a+")),
        ("/v1/chat/completions", {"guided_choice": ["y", "n"]}, StructuredOutputs(choice=("y", "n"))),
        ("/v1/chat/completions", {"guided_grammar": 'root ::= "a"'}, StructuredOutputs(grammar='root ::= "a"')),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ],
)
async def test_each_spelling_reaches_the_engine_as_one_constraint(path, body, expected):
    engine = FakeEngineClient()
    extra = {"messages": USER} if "chat" in path else {"prompt": "x"}
    r = await post(engine, path, {**extra, **body})
    assert r.status_code == 200, r.text
    assert engine.calls[0].params.structured_outputs == expected
    if expected is not None and expected.json is not None:  # the schema's key order survives to the engine
        assert list(json.loads(engine.calls[0].params.structured_outputs.json)["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"lark": "x"}}, "structured_outputs.lark"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": []}, "tools"),  # OpenAI's and vLLM's answer too
        ({"tools": [], "tool_choice": "none"}, "tools"),
        ({"tools": [WEATHER] * 129}, "tools"),  # OpenAI's limit is 128
    ],
)
async def test_bad_constraints_are_400s_that_name_the_field(body, param):
    engine = FakeEngineClient()
    r = await post(engine, "/v1/chat/completions", {"messages": USER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not engine.calls


async def test_an_engine_refusal_of_the_grammar_names_the_users_field():
    def script(prompt, params):
        return [InvalidRequest('invalid JSON schema: Unsupported type "nope"', "structured_outputs.json")]

    for body, param in [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]:
        for streamed in (False, True):
            r = await post(
                FakeEngineClient(script), "/v1/chat/completions", {"messages": USER, "stream": streamed, **body}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def joined_calls(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool calls of one streamed choice, joined the way OpenAI clients join them."""
    calls: dict[int, dict[str, Any]] = {}
    for c in choices:
        for d in c["delta"].get("tool_calls", ()):
            call = calls.setdefault(d["index"], {"function": {"arguments": ""}})
            if "id" in d:
                assert d["function"]["arguments"] == "" and call.get("id") is None  # the header comes first, once
                call.update(id=d["id"], type=d["type"])
                call["function"]["name"] = d["function"]["name"]
            else:
                assert call.get("id"), "argument fragments after the header"
                call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def without_ids(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in call.items() if k != "id"} for call in calls]


async def both(engine_script, body: dict[str, Any]):
    """(non-streamed choices, streamed choices by index) for the same scripted output."""
    r = await post(FakeEngineClient(engine_script), "/v1/chat/completions", {"messages": USER, **body})
    assert r.status_code == 200, r.text
    events = await stream(FakeEngineClient(engine_script), "/v1/chat/completions", {"messages": USER, **body})
    return r.json()["choices"], by_choice(events)


async def test_required_enforces_a_call_list_and_returns_tool_calls():
    engine = FakeEngineClient(replying(['[{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}]', ""]))
    r = await post(
        engine,
        "/v1/chat/completions",
        {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False},
    )
    schema = json.loads(engine.calls[0].params.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    prompt = engine.calls[0].prompt
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


@pytest.mark.parametrize(
    "choice_field, text, finish, calls",
    [
        (
            "required",
            ['[{"name": "get_time", "arguments": {}}, ', '{"name": "get_weather", "arguments": {"city": "Oslo"}}]'],
            "tool_calls",
            [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
        ),
        (
            {"type": "function", "function": {"name": "get_weather"}},
            ['{"ci', 'ty": "Ro', 'me"}'],
            "stop",
            [("get_weather", '{"city": "Rome"}')],
        ),
        (
            "auto",
            [
                "Let me check. ",
                "<tool",
                '_call>[{"name": "get_weather", ',
                '"arguments": {"city": "Lima"}}]</tool_call>',
            ],
            "tool_calls",
            [("get_weather", '{"city": "Lima"}')],
        ),
        ("auto", ["I can't <to", "ol> help", " <tool_call>[oops"], "stop", []),
    ],
)
async def test_streamed_tool_calls_join_to_the_non_streamed_ones(choice_field, text, finish, calls):
    body = {"tools": [WEATHER, TIME], "tool_choice": choice_field, "n": 2}
    full, streamed = await both(replying(text), body)
    for choice in full:
        message = choice["message"]
        assert choice["finish_reason"] == finish
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        assert got == calls
        chunks = streamed[choice["index"]]
        assert chunks[-1]["finish_reason"] == finish
        assert without_ids(joined_calls(chunks)) == without_ids(message.get("tool_calls") or [])
        content = "".join(c["delta"].get("content") or "" for c in chunks)
        assert content == (message["content"] or "")
    if choice_field == "auto" and calls:
        assert full[0]["message"]["content"] == "Let me check. "
        first_content = next(c for c in streamed[0] if c["delta"].get("content"))
        assert first_content["delta"]["content"] == "Let me check. "  # streamed before the call is complete
    if not calls:
        assert full[0]["message"]["content"] == "".join(text)


async def test_follow_up_turns_render_calls_and_results():
    engine = FakeEngineClient(replying(["It is sunny."]))
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = await post(engine, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    prompt = engine.calls[0].prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert in composing functions")
    assert (
        '<|im_start|>assistant\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
    r = await post(engine, "/v1/chat/completions", {"messages": messages, "tools": [WEATHER], "tool_choice": "none"})
    assert r.status_code == 200 and "<tools>" not in engine.calls[-1].prompt


async def test_a_template_that_reads_tools_gets_them():
    from tests.fake_engine import FAKE_MODEL

    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"  # noqa: E501
    model = type(FAKE_MODEL)(FAKE_MODEL.name, chat_template=template)
    engine = FakeEngineClient(replying(["ok"]), models=[model])
    r = await post(engine, "/v1/chat/completions", {"messages": USER, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    assert engine.calls[0].prompt == "[get_weather][get_time]user:Weather in Paris?;"


def test_auto_holds_back_only_what_may_start_a_call():
    s = ToolCallStream(ToolPlan("auto", ()))
    assert s.feed("Hello <to") == [{"content": "Hello "}]
    assert s.feed("p> and") == [{"content": "<top> and"}]
    assert s.feed(" <tool_call>[") == [{"content": " "}]
    assert s.finish() == [{"content": "<tool_call>["}]  # not a valid call: released as text
    assert (
        parse_tagged_calls(
            '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>[{"name": "g", "parameters": {}}]'
        )
        is not None
    )
