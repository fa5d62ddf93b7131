"""The Responses API end to end: the openai client's `responses` and raw HTTP -> frontend -> real
tritonserver; stored in SQLite, and in a real PostgreSQL shared by two frontends; a frontend killed
mid-generation and its background response finished, exactly, by another."""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import threading
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from scripts.servers import Frontend, free_port
from tests.e2e.helpers import LOGS
from tests.e2e.triton_stream import metric_value, wait_until_aborted_and_freed

LONG = {"max_output_tokens": 96, "ignore_eos": True, "temperature": 0.8, "seed": 1234}
LONG_SDK = {"max_output_tokens": 96, "temperature": 0.8, "extra_body": {"ignore_eos": True, "seed": 1234}}


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=120)


def frames_of(text: str) -> list[str]:
    return [block + "\n\n" for block in text[:-2].split("\n\n")] if text else []


def event_of(frame: str) -> dict[str, Any]:
    return json.loads(frame.split("\ndata: ", 1)[1])


def joined_text(frames: list[str]) -> str:
    return "".join(e["delta"] for e in map(event_of, frames) if e["type"] == "response.output_text.delta")


def read_frames(url: str, response_id: str, after: int, out: list[str], timeout: float = 180) -> None:
    """A reader resuming the stream of `response_id` after `after` until it ends (appending to `out`)."""
    params = {"stream": "true", "starting_after": str(after)}
    with (
        httpx.Client(base_url=url, timeout=timeout) as http,
        http.stream("GET", f"/v1/responses/{response_id}", params=params) as r,
    ):
        assert r.status_code == 200, r.read()
        buffer = ""
        for chunk in r.iter_text():
            buffer += chunk
            while "\n\n" in buffer:
                frame, buffer = buffer.split("\n\n", 1)
                out.append(frame + "\n\n")


def test_streamed_events_equal_the_stored_response(client, servers):
    stream = client.responses.create(model=servers.model, input="Write about the sea.", stream=True, **LONG_SDK)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e for e in events if e.type == "response.output_text.done"]
    stored = client.responses.retrieve(events[-1].response.id)
    assert deltas == done.text == stored.output_text and deltas.strip()
    assert stored.status == "incomplete" and stored.incomplete_details.reason == "max_output_tokens"
    assert stored.usage.output_tokens == 96 and stored.usage.input_tokens > 0
    again = client.responses.create(model=servers.model, input="Write about the sea.", store=False, **LONG_SDK)
    assert again.output_text == deltas  # seeded: the same text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(again.id)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the same prompt: served by the prefix cache
    items = client.responses.input_items.list(stored.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Write about the sea."


def test_previous_response_id_and_json_schema_format(client, servers):
    first = client.responses.create(
        model=servers.model, input="My name is Ada.", instructions="Answer in one sentence.", max_output_tokens=24
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
        "additionalProperties": False,
    }
    second = client.responses.create(
        model=servers.model,
        input="What is my name? Reply as JSON.",
        previous_response_id=first.id,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.status == "completed"
    jsonschema.validate(json.loads(second.output_text), schema)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=servers.model, input="x", previous_response_id="resp_unknown")


def test_required_tool_call(client, servers):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    # Greedy and one call: sampled, the model may start call after call until max_output_tokens cuts the array.
    r = client.responses.create(
        model=servers.model,
        input="Weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    assert r.status == "completed", r.incomplete_details
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = client.responses.create(
        model=servers.model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp_c": 21}'}],
        max_output_tokens=16,
    )
    assert follow.status in ("completed", "incomplete")


def test_background_cancel_is_final(client, servers):
    r = client.responses.create(
        model=servers.model,
        input="Tell a long story.",
        background=True,
        max_output_tokens=2000,
        extra_body={"ignore_eos": True},
    )
    assert r.status in ("queued", "in_progress") and r.background
    deadline = time.monotonic() + 60
    while client.responses.retrieve(r.id).status == "queued" and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    time.sleep(0.5)
    assert client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=servers.model, input="x", background=True, store=False)


def test_a_foreground_stream_whose_client_leaves_is_cancelled_and_freed(servers):
    aborted_before = metric_value(servers.triton.metrics_url, "llm_aborted_requests_total")
    body = {"model": servers.model, "input": "Tell a long story.", "stream": True, "max_output_tokens": 2000}
    body["ignore_eos"] = True
    response_id = None
    with (
        httpx.Client(base_url=servers.frontend.url, timeout=60) as http,
        http.stream("POST", "/v1/responses", json=body) as r,
    ):
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                response_id = response_id or event["response"]["id"]  # response.created comes first
                if event["type"] == "response.output_text.delta":
                    break  # the client leaves
    wait_until_aborted_and_freed(servers.triton.metrics_url, aborted_before)
    with httpx.Client(base_url=servers.frontend.url, timeout=60) as http:
        deadline = time.monotonic() + 10
        while (status := http.get(f"/v1/responses/{response_id}").json()["status"]) != "cancelled":
            assert status == "in_progress" and time.monotonic() < deadline, status
            time.sleep(0.05)


def test_several_readers_resume_from_several_points(client, servers):
    body = {"model": servers.model, "input": "Describe a forest.", "background": True, "stream": True, **LONG}
    with httpx.Client(base_url=servers.frontend.url, timeout=180) as http:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200
        frames = frames_of(r.text)
    response_id = event_of(frames[0])["response"]["id"]
    points = [-1, 0, 5, len(frames) // 2, len(frames) - 2]
    outs: dict[int, list[str]] = {p: [] for p in points}
    readers = [
        threading.Thread(target=read_frames, args=(servers.frontend.url, response_id, p, outs[p])) for p in points
    ]
    for t in readers:
        t.start()
    for t in readers:
        t.join(120)
    for p in points:
        assert outs[p] == frames[p + 1 :]
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=5))  # the SDK's own call
    assert [e.sequence_number for e in resumed] == list(range(6, len(frames)))


def _kill_and_take_over(url_of_reader: str, generating: Frontend, restart: Frontend | None, model: str) -> None:
    """A background response generating on `generating` is followed by a reader on `url_of_reader`; the
    generating frontend is SIGKILLed part way; `restart` (if given) comes up on the same store; the reader's
    stream, resumed where it stopped, ends as an uninterrupted one would, with the text an uninterrupted run
    of the same request has."""
    body = {"model": model, "input": "Write a story about a lighthouse.", "background": True, **LONG}
    body["max_output_tokens"] = 160
    with httpx.Client(base_url=generating.url, timeout=60) as http:
        uninterrupted = http.post("/v1/responses", json={**body, "background": False, "store": False}).json()
        response_id = http.post("/v1/responses", json=body).json()["id"]
    seen: list[str] = []
    reader = threading.Thread(target=_read_until_cut, args=(url_of_reader, response_id, seen), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(seen) < 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    with httpx.Client(base_url=url_of_reader, timeout=60) as http:
        midway = http.get(f"/v1/responses/{response_id}").json()  # (on b: read back from its stored events)
    generating.proc.send_signal(signal.SIGKILL)
    generating.proc.wait(10)
    at_kill = len(seen)
    rest: list[str] = []
    if restart is None:  # the reader's frontend lives: its stream goes on through the takeover
        reader.join(120)
    else:  # the reader's stream died with its frontend: it resumes where it stopped
        reader.join(10)
        restart.start(log_path=LOGS / "frontend-responses-restarted.log")
        read_frames(url_of_reader, response_id, event_of(seen[-1])["sequence_number"], rest)
    frames = seen + rest
    assert 30 <= at_kill < len(frames) - 20, "killed part way: the rest came from the frontend that took it over"
    numbers = [event_of(f)["sequence_number"] for f in frames]
    assert numbers == list(range(len(frames))), "no event lost, none twice"
    final = event_of(frames[-1])
    assert final["type"] == "response.incomplete", final
    assert joined_text(frames) == final["response"]["output"][0]["content"][0]["text"]
    assert joined_text(frames) == uninterrupted["output"][0]["content"][0]["text"]
    with httpx.Client(base_url=url_of_reader, timeout=60) as http:
        stored = http.get(f"/v1/responses/{response_id}").json()
        replay = frames_of(http.get(f"/v1/responses/{response_id}", params={"stream": "true"}).text)
    assert stored["status"] == "incomplete" and stored["usage"]["output_tokens"] == 160
    assert midway["status"] == "in_progress" and midway["output"][0]["content"][0]["text"]
    assert joined_text(frames).startswith(midway["output"][0]["content"][0]["text"])
    assert replay == frames  # what a reader that never dropped gets, byte for byte


def _read_until_cut(url: str, response_id: str, out: list[str]) -> None:
    with contextlib.suppress(httpx.HTTPError):  # its frontend is killed
        read_frames(url, response_id, -1, out, timeout=30)


@pytest.mark.slow
def test_killed_frontend_is_taken_over_by_its_restart_exactly(servers):
    state = tempfile.mkdtemp(prefix="frontend-state-")
    args = ["--state-dir", state, "--response-lease-s", "1"]
    port = free_port()
    first = Frontend(servers.triton.grpc_url, port=port, extra_args=args)
    first.start(log_path=LOGS / "frontend-responses-killed.log")
    restarted = Frontend(servers.triton.grpc_url, port=port, extra_args=args)
    try:
        _kill_and_take_over(first.url, first, restarted, servers.model)
    finally:
        first.stop()
        restarted.stop()


@pytest.mark.slow
def test_two_frontends_on_one_postgresql(servers, postgresql):
    url = postgresql.create_database("responses_e2e")
    args = ["--response-store", url, "--response-lease-s", "1", "--response-poll-ms", "20"]
    a = Frontend(servers.triton.grpc_url, port=free_port(), extra_args=args)
    b = Frontend(servers.triton.grpc_url, port=free_port(), extra_args=args)
    a.start(log_path=LOGS / "frontend-responses-pg-a.log")
    b.start(log_path=LOGS / "frontend-responses-pg-b.log")
    try:
        # A reader on b follows a response that a generates, a dies, and b finishes it.
        _kill_and_take_over(b.url, a, None, servers.model)
    finally:
        a.stop()
        b.stop()
