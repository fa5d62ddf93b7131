"""/v1/responses against a FakeEngineClient and a real SQLite store: the service and its routes, with no
Triton (the e2e tests run the real servers and PostgreSQL).

Every streamed event is parsed with the openai SDK's own event types, and the streamed text is compared
with the stored response.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from openai_frontend.app import create_app
from openai_frontend.errors import EngineFailure
from openai_frontend.responses_api.store import ResponseStore
from openai_frontend.settings import Settings
from protocol import SamplingParams
from tests.fake_engine import FAKE_MODEL, FakeEngineClient, scripted_steps
from tests.frontend.test_response_store import record

pytestmark = pytest.mark.asyncio
MODEL = FAKE_MODEL.name
EVENT = TypeAdapter(ResponseStreamEvent)


def client_of(engine: FakeEngineClient, tmp_path: Path, **settings: Any) -> httpx.AsyncClient:
    app = create_app(engine, Settings(state_dir=str(tmp_path), **settings))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def frames_of(text: str) -> list[str]:
    assert text.endswith("\n\n")
    return [block + "\n\n" for block in text[:-2].split("\n\n")]


def events_of(text: str) -> list[dict[str, Any]]:
    events = []
    for frame in frames_of(text):
        head, data = frame.rstrip("\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: ") :])
        assert event["type"] == head[len("event: ") :]
        EVENT.validate_python(event)  # the SDK parses it
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(events[0]["sequence_number"], len(events)))
    return events


def text_script(tokens: list[str], finish: str = "stop", pause_s: float = 0.0):
    def script(prompt: str | list[int], params: SamplingParams) -> list[Any]:
        steps = scripted_steps([tokens], finish)
        if not pause_s:
            return list(steps)
        return [item for step in steps for item in (pause_s, step)]

    return script


async def test_non_streamed_response_is_stored_and_listed(tmp_path: Path) -> None:
    engine = FakeEngineClient(text_script(["Hello", ", ", "world"]))
    async with client_of(engine, tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "Say hi", "instructions": "Be brief"})
        assert r.status_code == 200, r.text
        body = r.json()
        response = Response.model_validate(body)
        assert response.status == "completed" and response.output_text == "Hello, world"
        assert body["id"].startswith("resp_") and body["object"] == "response"
        assert body["usage"]["output_tokens"] == 3 and body["usage"]["total_tokens"] == 8
        got = await client.get(f"/v1/responses/{body['id']}")
        assert got.status_code == 200 and got.json() == body
        items = (await client.get(f"/v1/responses/{body['id']}/input_items")).json()
        assert items["object"] == "list" and [i["role"] for i in items["data"]] == ["user"]
        assert items["data"][0]["content"] == [{"type": "input_text", "text": "Say hi"}]
        deleted = await client.delete(f"/v1/responses/{body['id']}")
        assert deleted.json() == {"id": body["id"], "object": "response.deleted", "deleted": True}
        missing = await client.get(f"/v1/responses/{body['id']}")
        assert missing.status_code == 404 and body["id"] in missing.json()["error"]["message"]
    prompt = engine.calls[0].prompt
    assert "Be brief" in prompt and "Say hi" in prompt  # instructions as the system message


async def test_streamed_events_equal_the_stored_response_and_replay_byte_for_byte(tmp_path: Path) -> None:
    tokens = ["One", " two", " three", " four"]
    async with client_of(FakeEngineClient(text_script(tokens, "length")), tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "Count", "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = events_of(r.text)
        types = [e["type"] for e in events]
        assert types[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert types[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == "".join(tokens)
        final = events[-1]["response"]
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}
        response_id = final["id"]
        stored = (await client.get(f"/v1/responses/{response_id}")).json()
        assert stored == final and Response.model_validate(stored).output_text == deltas
        frames = frames_of(r.text)
        for after in (-1, 0, 3, len(frames) - 2, len(frames) - 1):
            replay = await client.get(
                f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": after}
            )
            assert replay.status_code == 200
            assert (frames_of(replay.text) if replay.text else []) == frames[after + 1 :]


async def test_store_false_is_never_written(tmp_path: Path) -> None:
    async with client_of(FakeEngineClient(text_script(["a"])), tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "store": False})
        assert r.status_code == 200 and r.json()["status"] == "completed"
        assert (await client.get(f"/v1/responses/{r.json()['id']}")).status_code == 404
        bad = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "store": False, "background": True}
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "background"


async def test_previous_response_id_continues_the_conversation(tmp_path: Path) -> None:
    engine = FakeEngineClient(text_script(["Paris"]))
    async with client_of(engine, tmp_path) as client:
        first = (await client.post("/v1/responses", json={"model": MODEL, "input": "Capital of France?"})).json()
        second = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "And of Italy?", "previous_response_id": first["id"]}
        )
        assert second.status_code == 200 and second.json()["previous_response_id"] == first["id"]
        unknown = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    prompt = engine.calls[1].prompt
    assert prompt.index("Capital of France?") < prompt.index("Paris") < prompt.index("And of Italy?")


async def test_function_call_output_item(tmp_path: Path) -> None:
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    engine = FakeEngineClient(text_script([call[:20], call[20:]]))
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
    async with client_of(engine, tmp_path) as client:
        r = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "Weather?", "tools": tools, "stream": True}
        )
        events = events_of(r.text)
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    [item] = final["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather" and item["call_id"].startswith("call_")
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == item["arguments"]


async def test_engine_failure_mid_stream_is_an_error_event_then_failed(tmp_path: Path) -> None:
    steps = scripted_steps([["a", "b", "c"]], "stop")

    def script(prompt: str | list[int], params: SamplingParams) -> list[Any]:
        return [steps[0], EngineFailure("the engine fell over")]

    async with client_of(FakeEngineClient(script), tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": True})
        events = events_of(r.text)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["message"] == "the engine fell over"
        stored = (await client.get(f"/v1/responses/{events[-1]['response']['id']}")).json()
        assert stored["status"] == "failed" and stored["output"][0]["content"][0]["text"] == "a"


async def test_background_runs_without_its_client_and_cancel_is_final(tmp_path: Path) -> None:
    engine = FakeEngineClient(text_script([f"w{i} " for i in range(200)], pause_s=0.01))
    async with client_of(engine, tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "long", "background": True})
        assert r.status_code == 200 and r.json()["status"] == "queued" and r.json()["background"] is True
        response_id = r.json()["id"]
        for _ in range(200):
            status = (await client.get(f"/v1/responses/{response_id}")).json()["status"]
            if status == "in_progress":
                break
            await asyncio.sleep(0.01)
        assert status == "in_progress"
        cancelled = await client.post(f"/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        again = await client.post(f"/v1/responses/{response_id}/cancel")
        assert again.status_code == 400 and "cancelled" in again.json()["error"]["message"]
        await asyncio.sleep(0.1)
        assert (await client.get(f"/v1/responses/{response_id}")).json()["status"] == "cancelled"
        done = (await client.post("/v1/responses", json={"model": MODEL, "input": "x", "store": True})).json()
        finished = await client.post(f"/v1/responses/{done['id']}/cancel")
        assert finished.status_code == 400  # a foreground one, and finished
    assert engine.cancelled  # the engine request was stopped


async def test_background_stream_then_resume_from_every_point(tmp_path: Path) -> None:
    engine = FakeEngineClient(text_script([f"t{i} " for i in range(12)], pause_s=0.005))
    async with client_of(engine, tmp_path) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "background": True, "stream": True})
        frames = frames_of(r.text)
        response_id = events_of(r.text)[0]["response"]["id"]
        readers = [
            client.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": after})
            for after in range(-1, len(frames))
        ]
        for after, replay in zip(range(-1, len(frames)), await asyncio.gather(*readers), strict=True):
            assert (frames_of(replay.text) if replay.text else []) == frames[after + 1 :]


async def test_unsupported_input_and_tools_are_400s_naming_the_field(tmp_path: Path) -> None:
    async with client_of(FakeEngineClient(), tmp_path) as client:
        image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]
        r = await client.post("/v1/responses", json={"model": MODEL, "input": image})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("input.0.content.0")
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.type"
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens"
        r = await client.get("/v1/responses/resp_missing/input_items")
        assert r.status_code == 404


async def test_store_unreachable_is_a_503_and_store_false_goes_on(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    down = f"postgresql://user:secret@127.0.0.1:{port}/responses"
    async with client_of(FakeEngineClient(text_script(["a"])), tmp_path, response_store=down) as client:
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable", r.text
        assert "secret" not in r.text
        r = await client.get("/v1/responses/resp_x")
        assert r.status_code == 503
        r = await client.post("/v1/responses", json={"model": MODEL, "input": "x", "store": False})
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "a"


async def test_a_served_model_alias_reports_the_first_served_name(tmp_path: Path) -> None:
    from openai_frontend.served_names import ServedNames

    names = ServedNames.parse(["first-name", "second-name"])
    async with client_of(FakeEngineClient(text_script(["a"])), tmp_path, served_names=names) as client:
        r = await client.post("/v1/responses", json={"model": "second-name", "input": "x"})
        assert r.status_code == 200 and r.json()["model"] == "first-name", r.text
        assert (await client.get(f"/v1/responses/{r.json()['id']}")).json()["model"] == "first-name"


@pytest.mark.timeout(60)  # (a stop that never ends blocks the loop, past asyncio's own timeout)
async def test_stops_all_through_the_sweepers_first_pass_end_and_leave_the_store_unlocked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweeper's first pass (orphans, then retention) starts with the app. A stop that closed the store
    under a pass still running never ended; one that cancelled a query mid-way left its connection open,
    holding SQLite's lock, so the next start found the store locked. Stops come all through that pass."""
    settings = Settings(state_dir=str(tmp_path), response_store_max=100)
    store = ResponseStore.from_url(settings.response_store_url())
    await store.open()
    try:
        old = time.time() - 3600
        for i in range(420):  # finished, past the cap: the first pass deletes most
            await store.create(record(f"resp_{i}", status="completed", owner=None, created_at=old + i))
    finally:
        await store.close()
    for attempt in range(40):
        app = create_app(FakeEngineClient(), settings)
        async with asyncio.timeout(20):
            async with app.router.lifespan_context(app):
                await asyncio.sleep(attempt * 0.0005)
    assert "unreachable" not in caplog.text
