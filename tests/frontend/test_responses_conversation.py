"""The Responses request schema and its conversion: input items, instructions and earlier turns -> one chat request
(rendered through the real chat template path), the input items as the SDK lists them, the response skeleton as the
SDK's Response, and a 400 naming the field for everything this server does not do."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import (
    Response,
    ResponseFunctionToolCallItem,
    ResponseFunctionToolCallOutputItem,
    ResponseInputMessageItem,
    ResponseItem,
    ResponseOutputMessage,
)
from pydantic import TypeAdapter, ValidationError

from openai_frontend.chat_prompt import ChatInput, rendered_chat
from openai_frontend.errors import InvalidRequest
from openai_frontend.responses_api.conversation import chat_param, chat_request, listed_input_items, response_object
from openai_frontend.responses_api.schemas import ResponsesRequest
from openai_frontend.schemas import MAX_MESSAGES, MAX_TOOL_PARAMETERS_CHARS, ChatCompletionRequest
from openai_frontend.tool_calls import CALL_OPEN, tool_plan
from tests.fake_engine import FAKE_MODEL

RESPONSE_ITEM = TypeAdapter(ResponseItem)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": '{"celsius": 21}'}


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "fake-llm", **fields})


def messages(req: ResponsesRequest, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    chat = chat_request(req, history or [], seed=7)
    return [m.model_dump(exclude_none=True) for m in chat.messages]


def refused(param: str, **fields: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        chat_request(request(**fields), [], None)
    assert e.value.param == param, e.value.message
    return e.value


def rendered(chat: ChatCompletionRequest) -> str:
    """The prompt ChatService.plan renders for `chat` (the test model's ChatML template, as SmolLM2's)."""
    return rendered_chat(FAKE_MODEL, ChatInput(chat.messages, tool_plan(chat), True, False, None)).text


# -- input -> chat messages ------------------------------------------------------------------------


def test_a_string_input_is_one_user_message():
    chat = chat_request(request(input="Hi there"), [], seed=7)
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [{"role": "user", "content": "Hi there"}]
    assert chat.seed == 7 and chat.stream is False and chat.tools is None and chat.response_format is None
    assert rendered(chat) == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_instructions_go_first_as_a_system_message():
    got = messages(request(input="Hi", instructions="Answer in French."))
    assert got == [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]


def test_message_items_of_each_form():
    got = messages(
        request(
            input=[
                {"role": "developer", "content": "Be brief."},
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "No jokes."}]},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "?"}],
                },
                {
                    "type": "message",
                    "id": "msg_abc",
                    "status": "completed",
                    "role": "assistant",
                    "phase": "final_answer",  # fields of OpenAI's output items are ignored inside items
                    "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}],
                },
            ]
        )
    )
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "No jokes."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
    ]


def test_calls_of_one_turn_and_the_text_before_them_are_one_assistant_message():
    second = {**CALL, "call_id": "call_2", "arguments": '{"city": "Rome"}'}
    got = messages(
        request(
            input=[
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "Let me look."},
                CALL,
                second,
                RESULT,
                {**RESULT, "call_id": "call_2", "output": [{"type": "input_text", "text": "18"}]},
                {"role": "assistant", "content": "Paris 21, Rome 18."},
                CALL,
            ],
            tools=[WEATHER],
        )
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    call_2 = {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    assert got == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call_2]},
        {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
        {"role": "tool", "content": [{"type": "text", "text": "18"}], "tool_call_id": "call_2"},
        {"role": "assistant", "content": "Paris 21, Rome 18.", "tool_calls": [call]},
    ]


def test_a_call_without_text_before_it_is_an_assistant_message_of_calls_only():
    got = messages(request(input=[{"role": "user", "content": "Paris?"}, CALL, RESULT], tools=[WEATHER]))
    assert got[1]["role"] == "assistant" and "content" not in got[1] and len(got[1]["tool_calls"]) == 1


def test_history_then_input_round_trip_renders_through_the_chat_template():
    """Turn 1 asks; its output (as events.py stores it) is a call; turn 2 sends the call's result."""
    first = request(input="Weather in Paris?", instructions="Old instructions.", tools=[WEATHER])
    output = [
        {
            "id": "msg_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}],
        },
        {"id": "fc_1", "type": "function_call", "status": "completed", **{k: CALL[k] for k in CALL if k != "type"}},
    ]
    history = [*listed_input_items(first), *output]
    second = request(input=[RESULT], instructions="Answer briefly.", previous_response_id="resp_1", tools=[WEATHER])
    chat = chat_request(second, history, seed=3)
    got = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert got == [
        {"role": "system", "content": "Answer briefly."},  # this request's instructions only, as OpenAI does
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": '{"celsius": 21}', "tool_call_id": "call_1"},
    ]
    prompt = rendered(chat)
    assert prompt.startswith("<|im_start|>system\nAnswer briefly.")
    assert '"name": "get_weather"' in prompt  # the tools, in the system prompt of a template that does not read them
    assert f'Checking.\n{CALL_OPEN}[\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}' in prompt
    assert '<tool_response>\n{"celsius": 21}\n</tool_response>' in prompt
    assert "Old instructions." not in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_an_empty_conversation_names_input():
    refused("input", input=[])
    refused("input")
    assert messages(request(input=[], instructions="Say hi.")) == [{"role": "system", "content": "Say hi."}]
    assert len(messages(request(input=[]), [{"role": "user", "content": "Hi"}])) == 1


def test_a_conversation_past_the_message_bound_names_input():
    history = [{"role": "user", "content": "Hi"}] * MAX_MESSAGES
    with pytest.raises(InvalidRequest) as e:
        chat_request(request(input="One more"), history, None)
    assert e.value.param == "input"


# -- the other fields -> chat fields ---------------------------------------------------------------


def test_sampling_fields_go_as_they_are():
    chat = chat_request(
        request(
            input="Hi",
            max_output_tokens=50,
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.3,
            stop=["\n\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            min_tokens=3,
            seed=11,
            truncation="auto",
            stream=True,
            metadata={"k": "v"},
            user="u",
        ),
        [],
        seed=11,
    )
    assert chat.max_completion_tokens == 50 and chat.max_tokens is None
    assert (chat.temperature, chat.top_p, chat.top_k, chat.min_p) == (0.5, 0.9, 40, 0.05)
    assert (chat.repetition_penalty, chat.presence_penalty, chat.frequency_penalty) == (1.1, 0.2, 0.3)
    assert chat.stop == ["\n\n"] and chat.stop_token_ids == [2] and chat.ignore_eos and chat.min_tokens == 3
    assert chat.seed == 11 and chat.truncate_prompt_tokens == -1 and chat.stream is False


def test_the_seed_is_the_one_the_service_gives():
    assert chat_request(request(input="Hi", seed=1), [], seed=99).seed == 99


@pytest.mark.parametrize(
    ("text", "response_format"),
    [
        ({"format": {"type": "text"}, "verbosity": "low"}, None),
        ({"format": {"type": "json_object"}}, {"type": "json_object"}),
        (
            {"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}},
            {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}},
        ),
    ],
)
def test_text_format_is_the_response_format(text, response_format):
    chat = chat_request(request(input="Hi", text=text), [], None)
    got = chat.response_format.model_dump(by_alias=True, exclude_none=True) if chat.response_format else None
    assert got == response_format


@pytest.mark.parametrize(
    ("tool_choice", "chat_choice", "mode"),
    [
        (None, None, "auto"),
        ("auto", "auto", "auto"),
        ("none", "none", "none"),
        ("required", "required", "required"),
        (
            {"type": "function", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            "named",
        ),
    ],
)
def test_tool_choice(tool_choice, chat_choice, mode):
    chat = chat_request(request(input="Hi", tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False), [], 1)
    got = chat.tool_choice.model_dump() if hasattr(chat.tool_choice, "model_dump") else chat.tool_choice
    assert got == chat_choice
    plan = tool_plan(chat)
    assert plan.mode == mode and plan.parallel is False
    assert plan.tools[0].function.model_dump(exclude_none=True) == {k: v for k, v in WEATHER.items() if k != "type"}


def test_auto_without_tools_is_no_tools_as_openai_reads_it():
    assert tool_plan(chat_request(request(input="Hi", tool_choice="auto", tools=[]), [], 1)).mode == "none"


# -- what is refused, by name ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    ["web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
     "image_generation", "mcp", "local_shell", "custom"],
)  # fmt: skip
def test_built_in_tools_are_refused_by_index(kind):
    e = refused("tools.1.type", input="Hi", tools=[WEATHER, {"type": kind}])
    assert "built-in tools" in e.message and kind in e.message


@pytest.mark.parametrize(
    ("item", "param"),
    [
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]},
            "input.1.content.0.type",
        ),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.1.content.0.type"),
        ({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}, "input.1.content.0.type"),
        ({**RESULT, "output": [{"type": "input_text", "text": "a"}, {"type": "input_image"}]}, "input.1.output.1.type"),
        ({"type": "reasoning", "id": "rs_1", "summary": []}, "input.1.type"),
        ({"type": "item_reference", "id": "msg_1"}, "input.1.type"),
        ({"type": "web_search_call", "id": "ws_1", "status": "completed"}, "input.1.type"),
        ({"type": "computer_call_output", "call_id": "c", "output": {}}, "input.1.type"),
        ({"content": "no role, no type"}, "input.1.type"),
    ],
)
def test_unsupported_item_and_part_types_are_refused_by_path(item, param):
    with pytest.raises(InvalidRequest) as e:
        request(input=[{"role": "user", "content": "Hi"}, item])
    assert e.value.param == param
    assert "not supported" in e.value.message or "needs a type" in e.value.message


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
        ({"type": "function_call_output", "call_id": "c"}, "input.0.output"),
        ({"role": "tool", "content": "x"}, "input.0.role"),
        ({"role": "user", "content": [{"type": "input_text"}]}, "input.0.content.0.text"),
        ({"role": "user", "content": 5}, "input.0.content"),
        ("not an object", "input.0"),
    ],
)
def test_a_malformed_item_names_its_field(item, param):
    with pytest.raises(InvalidRequest) as e:
        request(input=[item])
    assert e.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"]}, "include.0"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True, "store": False}, "background"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice.type"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"text": {"format": {"type": "text", "schema": {}}}}, "text.format.schema"),
        ({"input": [{"role": "user", "content": "\ud800"}]}, "input.0.content"),
        ({"input": [{"role": "user", "content": "Hi"}] * (MAX_MESSAGES + 1)}, "input"),
    ],
)
def test_unsupported_fields_are_refused_by_name(fields, param):
    with pytest.raises(InvalidRequest) as e:
        request(**{"input": "Hi", **fields})
    assert e.value.param == param


@pytest.mark.parametrize(
    ("fields", "loc", "kind"),
    [
        ({"frobnicate": 1}, ("frobnicate",), "extra_forbidden"),
        ({"context_management": [{"type": "compaction"}]}, ("context_management",), "extra_forbidden"),
        ({"tools": [{**WEATHER, "defer_loading": True}]}, ("tools", 0, "defer_loading"), "extra_forbidden"),
        ({"text": {"format": {"type": "xml"}}}, ("text", "format", "type"), "literal_error"),
        ({"max_output_tokens": 0}, ("max_output_tokens",), "greater_than_equal"),
        ({"truncation": "middle"}, ("truncation",), "literal_error"),
        ({"include": ["everything"]}, ("include", 0), "literal_error"),
        ({"reasoning": {"effort": "huge"}}, ("reasoning", "effort"), "literal_error"),
        ({"tools": [{**WEATHER, "name": "not a name"}]}, ("tools", 0, "name"), "string_pattern_mismatch"),
        ({"tools": [WEATHER] * 129}, ("tools",), "too_long"),
    ],
)
def test_schema_errors_locate_the_field(fields, loc, kind):
    """What the app's validation handler reads: the error's type and location (its `param`)."""
    with pytest.raises(ValidationError) as e:
        request(**{"input": "Hi", **fields})
    error = e.value.errors()[0]
    assert (error["loc"], error["type"]) == (loc, kind)


def test_a_tool_parameters_schema_past_the_bound_is_refused():
    big = {**WEATHER, "parameters": {"type": "object", "description": "x" * MAX_TOOL_PARAMETERS_CHARS}}
    with pytest.raises(ValidationError) as e:
        request(input="Hi", tools=[big])
    assert e.value.errors()[0]["loc"] == ("tools", 0, "parameters")


def test_fields_accepted_and_not_used():
    req = request(
        input="Hi",
        reasoning={"effort": "low", "summary": "auto"},
        include=["reasoning.encrypted_content", "file_search_call.results"],
        stream_options={"include_obfuscation": False},
        store=None,
        background=None,
        top_logprobs=0,
        max_tool_calls=3,
        service_tier="flex",
        prompt_cache_key="k",
        prompt_cache_retention="24h",
        safety_identifier="s",
        text={"verbosity": "high"},
    )
    assert req.store is True and req.background is False
    chat_request(req, [], 1)


def test_chat_errors_are_named_as_the_responses_request_names_them():
    refused("logit_bias", input="Hi", logit_bias={"x": 1.0})
    with pytest.raises(InvalidRequest) as e:
        chat_request(request(input=[{"role": "user", "content": "Hi"}, *[CALL] * 129]), [], None)
    assert e.value.param == "input"


@pytest.mark.parametrize(
    ("chat", "responses"),
    [
        (None, None),
        ("max_completion_tokens", "max_output_tokens"),
        ("max_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
        ("response_format.json_schema.schema", "text.format.schema"),
        ("messages", "input"),
        ("messages.3.content", "input"),
        ("tools", "tools"),
        ("tools.2.function.parameters", "tools.2.parameters"),
        ("tool_choice", "tool_choice"),
        ("tool_choice.function.name", "tool_choice.name"),
        ("truncate_prompt_tokens", "truncation"),
        ("temperature", "temperature"),
        ("stop", "stop"),
    ],
)
def test_chat_param(chat, responses):
    assert chat_param(chat) == responses


# -- what is stored and listed ---------------------------------------------------------------------


def test_listed_input_items_are_the_sdks_items():
    req = request(
        input=[
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "assistant", "content": "Hello."},
            {"id": "msg_given", "type": "message", "role": "assistant", "status": "incomplete",
             "content": [{"type": "output_text", "text": "Cut", "annotations": []}]},
            CALL,
            RESULT,
            {**RESULT, "output": [{"type": "input_text", "text": "21"}]},
        ]
    )  # fmt: skip
    listed = listed_input_items(req)
    parsed = [RESPONSE_ITEM.validate_python(item) for item in listed]
    assert [type(p) for p in parsed] == [
        ResponseInputMessageItem,
        ResponseInputMessageItem,
        ResponseOutputMessage,
        ResponseOutputMessage,
        ResponseFunctionToolCallItem,
        ResponseFunctionToolCallOutputItem,
        ResponseFunctionToolCallOutputItem,
    ]
    assert [item["id"][: item["id"].index("_") + 1] for item in listed] == ["msg_"] * 4 + ["fc_", "fco_", "fco_"]
    assert listed[0]["content"] == [{"type": "input_text", "text": "Hi"}] and listed[0]["status"] == "completed"
    assert listed[2]["content"] == [{"type": "output_text", "text": "Hello.", "annotations": []}]
    assert listed[3]["id"] == "msg_given" and listed[3]["status"] == "incomplete"
    assert len({item["id"] for item in listed}) == len(listed)
    # Stored, they are input again: the next turn's history renders the same conversation.
    assert rendered(chat_request(request(input=[]), listed, None)) == rendered(chat_request(req, [], None))


def test_a_string_input_is_listed_as_one_user_message():
    (item,) = listed_input_items(request(input="Hi"))
    assert isinstance(RESPONSE_ITEM.validate_python(item), ResponseInputMessageItem)
    assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "Hi"}]


def test_the_response_object_is_the_sdks_response():
    plain = Response.model_validate(response_object(request(input="Hi"), "resp_1", 1700000000, "queued"))
    assert (plain.status, plain.output, plain.tools, plain.tool_choice) == ("queued", [], [], "auto")
    assert (plain.temperature, plain.top_p, plain.parallel_tool_calls, plain.truncation) == (1.0, 1.0, True, "disabled")
    assert plain.text.format.type == "text" and plain.metadata == {} and plain.background is False
    assert plain.reasoning.effort is None and plain.usage is None and plain.error is None

    req = request(
        input="Hi",
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "city", "schema": {"type": "object"}}},
        temperature=0.2,
        max_output_tokens=64,
        previous_response_id="resp_0",
        background=True,
        reasoning={"effort": "high"},
        metadata={"k": "v"},
    )
    full = Response.model_validate(response_object(req, "resp_2", 1700000000, "in_progress"))
    assert full.tools[0].name == "get_weather" and full.tools[0].parameters == WEATHER["parameters"]
    assert full.tool_choice.type == "function" and full.tool_choice.name == "get_weather"
    assert full.text.format.type == "json_schema" and full.text.format.name == "city"
    assert (full.instructions, full.temperature, full.max_output_tokens) == ("Be brief.", 0.2, 64)
    assert full.previous_response_id == "resp_0" and full.background is True and full.parallel_tool_calls is False
    assert full.reasoning.effort is None  # this model does not reason: the effort asked for is not applied
