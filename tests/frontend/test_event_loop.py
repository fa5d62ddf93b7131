"""The event loop never waits on a big prompt: while /tokenize of a multi-MiB prompt, a chat completion
that truncates a huge prompt, or a slow chat template render runs, GET /health still answers at once
(the frontend's app against a FakeEngineClient, the real SmolLM2 tokenizer)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Awaitable

import httpx
import pytest

from openai_frontend.app import create_app
from openai_frontend.settings import Settings, parse_settings
from openai_frontend.tokenizers import INLINE_WORK_CHARS, Tokenizers
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


async def test_prompt_threads_is_a_setting() -> None:
    assert parse_settings(["--prompt-threads", "3"]).prompt_threads == 3
    with pytest.raises(ValueError):
        Settings(prompt_threads=0)
