"""X-Request-Id in and out, and the access log line (openai_frontend/request_log.py)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import httpx
import pytest

from openai_frontend.app import create_app
from openai_frontend.request_log import MAX_LOGGED_CHARS, clipped
from openai_frontend.settings import Settings
from protocol import RequestTimings
from tests.fake_engine import FAKE_MODEL, FakeEngineClient, scripted_steps

MODEL = FAKE_MODEL.name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


def client(engine: FakeEngineClient, settings: Settings | None = None) -> httpx.AsyncClient:
    app = create_app(engine, settings or Settings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "openai_frontend.access"]


async def test_a_client_id_names_the_response_and_the_engine_request() -> None:
    engine = FakeEngineClient()
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
        r2 = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}, headers={"X-Request-Id": "x"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123"
    assert re.fullmatch(r"chatcmpl-abc-123-[0-9a-f]{8}-0", engine.calls[0].request_id)
    assert r2.json()["id"] == "cmpl-x"
    ids = [call.request_id for call in engine.calls[1:]]
    assert re.fullmatch(r"cmpl-x-[0-9a-f]{8}-0", ids[0]) and ids[1] == ids[0][:-1] + "1"


async def test_the_same_client_id_twice_is_two_engine_requests() -> None:
    engine = FakeEngineClient()
    async with client(engine) as c:
        for _ in range(2):
            await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "same"})
    assert engine.calls[0].request_id != engine.calls[1].request_id


async def test_without_a_header_a_generated_id_is_echoed_and_used() -> None:
    engine = FakeEngineClient()
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        missing = await c.get("/no/such/route")
        too_large = await c.post("/v1/completions", content=b"x" * (9 * 2**20))
    rid = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert f'"id":"chatcmpl-{rid}"' in r.text
    assert engine.calls[0].request_id == f"chatcmpl-{rid}-0"
    for other, status in ((missing, 404), (too_large, 413)):
        assert other.status_code == status and re.fullmatch(r"[0-9a-f]{32}", other.headers["x-request-id"])


@pytest.mark.parametrize("bad", ["x" * 129, "has space", "caf\u00e9"])
async def test_a_malformed_header_is_a_400_naming_it(bad: str) -> None:
    engine = FakeEngineClient()
    async with client(engine) as c:
        r = await c.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad.encode("utf-8")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
    assert not engine.calls


@pytest.mark.parametrize("stream", [False, True])
async def test_the_access_line_of_a_generation(stream: bool, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    async with client(FakeEngineClient()) as c:
        r = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream}, headers={"X-Request-Id": "r1"})
    assert r.status_code == 200
    [line] = access_lines(caplog)
    assert line["request_id"] == "r1" and line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert line["status"] == 200 and line["duration_s"] >= line["ttft_s"] >= 0 and line["client"]
    assert line["prompt_tokens"] > 0 and (line["completion_tokens"], line["cached_tokens"]) == (2, 0)
    if not stream:
        assert line["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert line["finish_reasons"] == ["length"]
    assert (line["queue_s"], line["prefill_s"], line["decode_s"]) == (0.25, 0.125, 0.5)  # the engine's (FAKE_TIMINGS)
    assert "prompts" not in line and "outputs" not in line  # never by default


async def test_the_engine_phases_of_several_sequences_are_each_the_largest(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    timings = {"a": RequestTimings(0.5, 0.125, 0.25), "b": RequestTimings(0.25, 0.375, 1.0)}

    def script(prompt, params):
        return scripted_steps([["x", "y"]] * params.n, timings=timings[prompt])

    async with client(FakeEngineClient(script)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 2})
    assert r.status_code == 200
    untimed = FakeEngineClient(lambda prompt, params: scripted_steps([["x"]], timings=None))  # a model without them
    async with client(untimed) as c:
        await c.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 1})
    timed_line, untimed_line = access_lines(caplog)
    assert (timed_line["queue_s"], timed_line["prefill_s"], timed_line["decode_s"]) == (0.5, 0.375, 1.0)
    assert untimed_line["queue_s"] is untimed_line["prefill_s"] is untimed_line["decode_s"] is None
    assert untimed_line["completion_tokens"] == 1


async def test_the_access_line_of_an_embedding_has_its_engine_phases(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    async with client(FakeEngineClient()) as c:
        r = await c.post("/v1/embeddings", json={"model": MODEL, "input": ["one", "two"]})
    assert r.status_code == 200
    [line] = access_lines(caplog)
    assert (line["queue_s"], line["prefill_s"], line["decode_s"]) == (0.25, 0.125, 0.0)


async def test_the_access_line_of_an_error(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    async with client(FakeEngineClient()) as c:
        await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    [line] = access_lines(caplog)
    assert line["status"] == 404 and "prompt_tokens" not in line


async def test_log_requests_adds_prompts_and_outputs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    body = {"model": MODEL, "prompt": "one two", "max_tokens": 2, "n": 2, "stream": True}
    async with client(FakeEngineClient(), Settings(log_requests=True)) as c:
        await c.post("/v1/completions", json=body)
    [line] = access_lines(caplog)
    assert line["prompts"] == ["one two"]
    assert line["outputs"] == ["s0t0 s0t1 ", "s1t0 s1t1 "]
    assert line["finish_reasons"] == ["length", "length"]


def test_logged_texts_are_clipped() -> None:
    assert clipped("a" * MAX_LOGGED_CHARS) == "a" * MAX_LOGGED_CHARS
    assert clipped("a" * (MAX_LOGGED_CHARS + 1)) == "a" * MAX_LOGGED_CHARS + "..."
