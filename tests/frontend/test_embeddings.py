"""POST /v1/embeddings against a FakeEngineClient: request validation, the response's shape, the engine
requests it makes (Task.EMBED, one per input, one admission group) and the errors (OpenAI's JSON)."""

from __future__ import annotations

import base64
from typing import Any

import httpx
import numpy as np
import pytest

from openai_frontend.app import create_app
from openai_frontend.errors import InvalidRequest
from openai_frontend.settings import Settings
from protocol import SamplingParams, Task
from tests.fake_engine import FAKE_HIDDEN_SIZE, FAKE_MODEL, FakeEngineClient, fake_embedding
from tests.frontend.test_api import _metric

pytestmark = pytest.mark.asyncio
MODEL = FAKE_MODEL.name


async def post(engine: FakeEngineClient, body: dict[str, Any], settings: Settings | None = None) -> httpx.Response:
    app = create_app(engine, settings or Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post("/v1/embeddings", json={"model": MODEL, **body})


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("hello there", ["hello there"]),
        (["a b", "c"], ["a b", "c"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
async def test_each_input_shape_is_one_embed_request_per_prompt(value: Any, prompts: list[Any]) -> None:
    engine = FakeEngineClient()
    r = await post(engine, {"input": value})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("embd-")
    assert isinstance(body["created"], int)
    assert [d["index"] for d in body["data"]] == list(range(len(prompts)))
    for d, prompt in zip(body["data"], prompts):
        assert d["object"] == "embedding"
        assert d["embedding"] == pytest.approx(list(fake_embedding(prompt)))
    tokens = sum(len(p) if isinstance(p, list) else len(p.split()) for p in prompts)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [c.prompt for c in engine.calls] == prompts
    assert all(c.task is Task.EMBED and c.params == SamplingParams() for c in engine.calls)
    group = {c.admission_group for c in engine.calls}
    if len(prompts) > 1:  # admitted together, as a completions batch
        (only,) = group
        assert only is not None and only.size == len(prompts)
    else:
        assert group == {None}
    assert len({c.request_id for c in engine.calls}) == len(prompts)


async def test_base64_is_the_little_endian_float32_bytes() -> None:
    engine = FakeEngineClient()
    plain = (await post(engine, {"input": ["x y", "z"]})).json()
    packed = (await post(engine, {"input": ["x y", "z"], "encoding_format": "base64"})).json()
    for a, b in zip(plain["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(a["embedding"], rel=1e-6)
        assert decoded.tolist() == np.asarray(a["embedding"], dtype=np.float32).tolist()


async def test_dimensions_is_accepted_only_as_the_models_own_size() -> None:
    engine = FakeEngineClient()
    r = await post(engine, {"input": "a", "dimensions": FAKE_HIDDEN_SIZE, "user": "someone"})
    assert r.status_code == 200, r.text
    assert len(r.json()["data"][0]["embedding"]) == FAKE_HIDDEN_SIZE
    for dims in (FAKE_HIDDEN_SIZE - 1, FAKE_HIDDEN_SIZE * 2):
        error = error_of(await post(FakeEngineClient(), {"input": "a", "dimensions": dims}), 400)
        assert error["param"] == "dimensions" and "does not support matryoshka representation" in error["message"]
        assert error["type"] == "invalid_request_error"
    error = error_of(await post(engine, {"input": "a", "dimensions": 0}), 400)
    assert error["param"] == "dimensions"


async def test_a_known_size_refuses_other_dimensions_before_engine_work() -> None:
    engine = FakeEngineClient()
    app = create_app(engine, Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        assert (await client.post("/v1/embeddings", json={"model": MODEL, "input": "a"})).status_code == 200
        calls = len(engine.calls)
        r = await client.post("/v1/embeddings", json={"model": MODEL, "input": "a", "dimensions": 3})
    assert error_of(r, 400)["param"] == "dimensions"
    assert len(engine.calls) == calls


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": [[1, 2**31]]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "temperature": 0.5}, "temperature"),
        ({"input": {"text": "a"}}, "input"),
    ],
)
async def test_malformed_requests_are_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    engine = FakeEngineClient()
    error = error_of(await post(engine, body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert engine.calls == []


async def test_inputs_per_request_are_bounded_like_completions_prompts() -> None:
    settings = Settings(max_prompts_per_request=3)
    engine = FakeEngineClient()
    assert (await post(engine, {"input": ["a"] * 3}, settings)).status_code == 200
    error = error_of(await post(FakeEngineClient(), {"input": ["a"] * 4}, settings), 400)
    assert error["param"] == "input" and "at most 3" in error["message"]


async def test_unknown_model_is_a_404() -> None:
    engine = FakeEngineClient()
    app = create_app(engine, Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/embeddings", json={"model": "nope", "input": "a"})
    assert error_of(r, 404)["code"] == "model_not_found"
    assert engine.calls == []


async def test_an_engine_refusal_names_input() -> None:
    def refuse(prompt: Any) -> list[Any]:
        return [
            InvalidRequest(
                "the prompt is 9000 tokens; this model's context is 8192 tokens", "prompt", "context_length_exceeded"
            )
        ]

    error = error_of(await post(FakeEngineClient(embed_script=refuse), {"input": ["a", "b"]}), 400)
    assert error["param"] == "input" and error["code"] == "context_length_exceeded"
    assert "the input is 9000 tokens" in error["message"]


async def test_a_response_without_a_vector_is_a_500() -> None:
    def generating(prompt: Any) -> list[Any]:
        from tests.fake_engine import default_script

        return default_script(prompt, SamplingParams())

    error = error_of(await post(FakeEngineClient(embed_script=generating), {"input": "a"}), 500)
    assert "without its vector" in error["message"]


async def test_the_triton_request_names_the_task_instead_of_sampling_params() -> None:
    from openai_frontend.triton_client import build_request

    embed = build_request(MODEL, [1, 2, 3], SamplingParams(), "r-0", None, Task.EMBED)
    assert [i.name for i in embed.inputs] == ["input_ids", "task"]
    assert embed.raw_input_contents[1][4:] == b"embed"
    generate = build_request(MODEL, "hi", SamplingParams(), "r-1")
    assert [i.name for i in generate.inputs] == ["text_input", "sampling_params"]


async def test_the_request_id_names_the_response_and_the_access_line_counts_its_tokens(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import json
    import logging
    import re

    caplog.set_level(logging.INFO, logger="openai_frontend.access")
    engine = FakeEngineClient()
    app = create_app(engine, Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post(
            "/v1/embeddings", json={"model": MODEL, "input": ["a b", "c"]}, headers={"X-Request-Id": "emb-1"}
        )
    assert r.status_code == 200 and r.json()["id"] == "embd-emb-1"
    assert all(re.fullmatch(rf"embd-emb-1-[0-9a-f]{{8}}-{i}", c.request_id) for i, c in enumerate(engine.calls))
    [line] = [json.loads(x.getMessage()) for x in caplog.records if x.name == "openai_frontend.access"]
    assert line["path"] == "/v1/embeddings" and line["prompt_tokens"] == 3 and line["completion_tokens"] == 0
    assert line["finish_reasons"] == ["stop", "stop"]


async def test_a_served_name_reaches_the_triton_model_as_an_embed_request() -> None:
    from openai_frontend.served_names import ServedNames

    engine = FakeEngineClient()
    settings = Settings(served_names=ServedNames.parse(("public-name",)))
    app = create_app(engine, settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/embeddings", json={"model": "public-name", "input": "a"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "public-name"
    assert [(c.model, c.task) for c in engine.calls] == [(MODEL, Task.EMBED)]


async def test_embeddings_are_counted_in_the_frontends_metrics() -> None:
    app = create_app(FakeEngineClient(), Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/embeddings", json={"model": MODEL, "input": ["a b", "c"]})
        assert r.status_code == 200, r.text
        text = (await client.get("/metrics")).text
    assert _metric(text, 'frontend_requests_total{endpoint="/v1/embeddings",status="200"}') == 1
    assert _metric(text, "frontend_embedding_inputs_total") == 2
    assert _metric(text, "frontend_prompt_tokens_total") == r.json()["usage"]["prompt_tokens"] > 0
    assert _metric(text, "frontend_e2e_request_latency_seconds_count") == 1
