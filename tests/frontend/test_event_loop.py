"""The event loop never waits on a big prompt: while /tokenize of a multi-MiB prompt, a chat completion
that truncates a huge prompt, or a slow chat template render runs, GET /health still answers at once
(the frontend's app against a FakeEngineClient, the real SmolLM2 tokenizer)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections.abc import Awaitable

import httpx
import pytest

from openai_frontend.app import create_app
from openai_frontend.settings import Settings, parse_settings
from openai_frontend.tokenizers import INLINE_WORK_CHARS, PROMPT_WORK_NICENESS, Tokenizers
from tests.fake_engine import FAKE_MODEL, FakeEngineClient

pytestmark = pytest.mark.asyncio

MODEL = dataclasses.replace(FAKE_MODEL, tokenizer_source="smollm2")
# A template whose work grows with the messages far faster than parsing them does (many steps per message).
SLOW_TEMPLATE = "{% for m in messages %}{% for i in range(800) %}{{ m['content'][i % 3] }}{% endfor %}{% endfor %}"
SLOW_MODEL = dataclasses.replace(FAKE_MODEL, name="slow-template", chat_template=SLOW_TEMPLATE)
HEALTH_BUDGET_S = 0.5  # generous: the point is that /health does not wait for the whole work
BIG_PROMPT = "The cat sat on the mat, 12 times over. " * (4 * 2**20 // 39)  # about 4 MiB


def client() -> httpx.AsyncClient:
    app = create_app(FakeEngineClient(models=(MODEL, SLOW_MODEL)), Settings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


async def health_delays_during(
    c: httpx.AsyncClient, work: Awaitable[httpx.Response]
) -> tuple[httpx.Response, float, list[float]]:
    """(work's response, how long it took, each /health probe's delay): a probe's delay runs from the
    moment it is due, so a loop held by the work shows up even though no probe could be sent meanwhile."""
    task = asyncio.ensure_future(work)
    start = time.perf_counter()
    delays: list[float] = []
    while not task.done():
        due = time.perf_counter()
        await asyncio.sleep(0.005)
        r = await c.get("/health")
        assert r.status_code == 200
        delays.append(time.perf_counter() - due - 0.005)
    response = await task
    return response, time.perf_counter() - start, delays


async def post_json(c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    # Encoded before the measurement starts, so the test's own work is not on the loop meanwhile.
    content = json.dumps(body).encode()
    return await c.post(path, content=content, headers={"content-type": "application/json"})


async def assert_health_answers_during(c: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    await c.post("/tokenize", json={"model": MODEL.name, "prompt": "warm up"})  # the tokenizer loads first
    response, took, delays = await health_delays_during(c, post_json(c, path, body))
    assert response.status_code == 200, response.text
    assert took > HEALTH_BUDGET_S, f"the work took {took:.2f} s: too little to show a stall"
    assert max(delays) < HEALTH_BUDGET_S, f"/health waited {max(delays):.2f} s while {path} ran {took:.2f} s"
    assert len(delays) >= 3
    return response


async def test_health_answers_while_a_multi_mib_prompt_is_tokenized() -> None:
    async with client() as c:
        r = await assert_health_answers_during(c, "/tokenize", {"model": MODEL.name, "prompt": BIG_PROMPT})
    body = r.json()
    assert body["count"] == len(body["tokens"]) > len(BIG_PROMPT) // 10


async def test_health_answers_while_a_huge_chat_prompt_is_truncated() -> None:
    body = {
        "model": MODEL.name,
        "messages": [{"role": "user", "content": BIG_PROMPT}],
        "truncate_prompt_tokens": 64,
        "return_token_ids": True,
        "max_tokens": 2,
    }
    async with client() as c:
        r = await assert_health_answers_during(c, "/v1/chat/completions", body)
    assert len(r.json()["prompt_token_ids"]) == 64


async def test_health_answers_while_a_chat_template_renders_many_messages() -> None:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(3000)]
    async with client() as c:
        r = await assert_health_answers_during(
            c, "/v1/chat/completions", {"model": SLOW_MODEL.name, "messages": messages, "max_tokens": 2}
        )
    assert r.json()["choices"][0]["message"]["content"]


async def test_small_prompt_work_runs_inline_and_big_work_on_a_worker_thread() -> None:
    tokenizers = Tokenizers(threads=1)
    loop_thread = threading.get_ident()
    assert await tokenizers.run(INLINE_WORK_CHARS, threading.get_ident) == loop_thread
    assert await tokenizers.run(INLINE_WORK_CHARS + 1, threading.get_ident) != loop_thread


async def test_prompt_work_threads_run_at_a_lower_priority_than_the_loop() -> None:
    """On a machine the engine shares, a big prompt's work takes only idle cores."""
    own = lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if own() >= PROMPT_WORK_NICENESS:
        pytest.skip("this test runs at the workers' nice value or above it")
    assert await Tokenizers(threads=1).run_on_thread(own) == PROMPT_WORK_NICENESS


async def test_prompt_threads_is_a_setting() -> None:
    assert parse_settings(["--prompt-threads", "3"]).prompt_threads == 3
    with pytest.raises(ValueError):
        Settings(prompt_threads=0)


# -- big request bodies are parsed and validated off the event loop (routers/common.py BigBodyRoute) --------

BIG_IDS_BODY = {"model": FAKE_MODEL.name, "prompt": list(range(1_000_000)), "max_tokens": 1}  # about 7 MiB


async def loop_gaps_during(c: httpx.AsyncClient, content: bytes) -> tuple[httpx.Response, float]:
    """(the response to POST /v1/completions of `content`, the longest the event loop went without running
    a 1 ms ticker meanwhile)."""
    task = asyncio.ensure_future(
        c.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    )
    longest, last = 0.0, time.perf_counter()
    while not task.done():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    return await task, longest


async def test_a_big_body_is_parsed_on_a_prompt_thread_and_the_loop_runs_meanwhile(monkeypatch) -> None:
    from openai_frontend.routers import common

    parsed_on: list[str] = []
    real = common._parse_and_validate

    def recorded(field, body):
        parsed_on.append(threading.current_thread().name)
        return real(field, body)

    monkeypatch.setattr(common, "_parse_and_validate", recorded)
    content = json.dumps(BIG_IDS_BODY).encode()
    async with client() as c:
        r = await c.post("/v1/completions", json={"model": FAKE_MODEL.name, "prompt": "small", "max_tokens": 1})
        assert r.status_code == 200 and parsed_on == []  # a small body: as before, on the loop
        r, off_loop = await loop_gaps_during(c, content)
        assert r.status_code == 200, r.text
        assert len(parsed_on) == 1 and parsed_on[0].startswith("prompt-work")
        monkeypatch.setattr(common, "BODY_INLINE_BYTES", len(content))  # the same body parsed on the loop
        r, on_loop = await loop_gaps_during(c, content)
        assert r.status_code == 200 and len(parsed_on) == 1
    # The loop still waits for the GIL in short turns (5 ms switch interval, a few C calls of a few ms).
    assert off_loop < on_loop / 2, f"loop gap {off_loop * 1e3:.0f} ms off the loop, {on_loop * 1e3:.0f} ms on it"


def _padded(body: dict) -> dict:
    return body | {"user": "x" * 300_000}  # past the inline size, valid anywhere


@pytest.mark.parametrize(
    "content",
    [
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": "hi", "suffix": "no"})),  # unknown field
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": "hi", "temperature": "hot"})),  # a field's type
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": [1, "two"]})),  # the union's errors
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": [5] * 100_000 + [2**40]})),  # a validator's 400
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": "hi"}))[:-1] + ",}",  # not JSON
        json.dumps(_padded({"model": FAKE_MODEL.name, "prompt": "hi", "x": "\ud800"})),  # a lone surrogate
        "[" + json.dumps(_padded({"model": FAKE_MODEL.name})) + "]",  # not an object
        b'{"model": "\xff' + b"x" * 300_000 + b'"}',  # not UTF-8
    ],
)
async def test_a_bad_big_body_gets_the_answer_a_bad_small_one_gets(monkeypatch, content) -> None:
    from openai_frontend.routers import common

    content = content if isinstance(content, bytes) else content.encode()
    assert len(content) > common.BODY_INLINE_BYTES
    headers = {"content-type": "application/json"}
    async with client() as c:
        off_loop = await c.post("/v1/completions", content=content, headers=headers)
        monkeypatch.setattr(common, "BODY_INLINE_BYTES", 1 << 30)
        on_loop = await c.post("/v1/completions", content=content, headers=headers)
    assert off_loop.status_code == on_loop.status_code == 400
    assert off_loop.json() == on_loop.json()


async def test_a_big_tokenize_body_is_validated_off_the_loop_with_the_same_errors(monkeypatch) -> None:
    from openai_frontend.routers import common

    body = {"model": MODEL.name, "messages": [{"role": "user", "content": "x" * 300_000}], "nope": 1}
    async with client() as c:
        off_loop = await post_json(c, "/tokenize", body)
        monkeypatch.setattr(common, "BODY_INLINE_BYTES", 1 << 30)
        on_loop = await post_json(c, "/tokenize", body)
    assert off_loop.status_code == on_loop.status_code == 400
    assert off_loop.json() == on_loop.json() and off_loop.json()["error"]["param"] == "nope"


# One object of half a million keys, within the default body limit: the C parser makes its dict in one call
# that holds the GIL (a microsecond or so a key; the validation of value-heavy bodies:
# tests/frontend/test_validation_cost.py).
MANY_KEYS_BODY = b'{"model": "fake-llm", "prompt": "x", "logit_bias": {%s}}' % b",".join(
    b'"%d": null' % i for i in range(500_000)
)


async def test_a_body_of_half_a_million_keys_is_read_in_python_and_the_loop_runs_meanwhile(monkeypatch) -> None:
    from openai_frontend.routers import common

    assert common._decoder_for(MANY_KEYS_BODY) is common._InterruptibleDecoder
    async with client() as c:
        r, python_scanner = await loop_gaps_during(c, MANY_KEYS_BODY)
        assert r.status_code == 400 and "65536 keys" in r.json()["error"]["message"], r.text
        monkeypatch.setattr(common, "_decoder_for", lambda body: json.JSONDecoder)  # the C parser, as before
        c_parser_response, c_parser = await loop_gaps_during(c, MANY_KEYS_BODY)
    assert c_parser_response.status_code == 400
    assert python_scanner < c_parser / 2, (
        f"loop gap {python_scanner * 1e3:.0f} ms with the Python scanner, {c_parser * 1e3:.0f} ms with C's"
    )


def test_both_parsers_read_a_body_alike() -> None:
    from openai_frontend.routers import common

    body = b'{"a": [null, true, false, 1, -2.5e3, 1e300, "\\u00e9\\ud83d\\ude00\\"", {"b": {}}, []], "x": 1, "x": 2}'
    assert json.loads(body, cls=common._InterruptibleDecoder, parse_int=int) == json.loads(body)


def test_an_object_of_too_many_keys_is_a_400() -> None:
    from openai_frontend.errors import InvalidRequest
    from openai_frontend.routers import common

    keys = b",".join(b'"%d": 0' % i for i in range(common.MAX_OBJECT_KEYS + 1))
    with pytest.raises(InvalidRequest, match="at most 65536 keys"):
        json.loads(b'{"m": {' + keys + b"}}", cls=common._InterruptibleDecoder)
