"""Beam search at the frontend (vLLM's use_beam_search, length_penalty, early_stopping): what reaches the
engine, and the combinations refused before it (the engine's own refusals: tests/backend/test_beam_search.py)."""

from __future__ import annotations

import pytest

from tests.fake_engine import FAKE_MODEL, FakeEngineClient
from tests.frontend.test_api import make_client

MODEL = FAKE_MODEL.name
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)])
async def test_beam_search_fields_reach_the_engine(path, body) -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post(
            path,
            json={
                "model": MODEL,
                **body,
                "n": 3,
                "max_tokens": 5,
                "use_beam_search": True,
                "length_penalty": 0.5,
                "early_stopping": True,
            },
        )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    p = engine.calls[0].params
    assert (p.use_beam_search, p.n, p.length_penalty, p.early_stopping) == (True, 3, 0.5, True)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "stream": True}, "use_beam_search"),
        ("/v1/chat/completions", {**CHAT, "stream": True}, "use_beam_search"),
        ("/v1/completions", {"prompt": "x", "stop": ["."]}, "stop"),
        ("/v1/completions", {"prompt": "x", "n": 11}, "n"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"prompt": "x", "length_penalty": 100}, "length_penalty"),
    ],
)
async def test_what_beam_search_cannot_honour_is_a_400_naming_the_field(path, body, param) -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post(path, json={"model": MODEL, "use_beam_search": True, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert engine.calls == []
