"""--served-model-name (openai_frontend/served_names.py) against a FakeEngineClient: the names clients see,
the Triton names the engine is asked for, and the flag's parsing."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from openai_frontend.served_names import ServedNames
from openai_frontend.settings import Settings, parse_settings
from tests.fake_engine import FAKE_MODEL, FakeEngineClient
from tests.frontend.test_api import make_client, parse_sse

MODEL = FAKE_MODEL.name
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def named(*values: str) -> Settings:
    return Settings(served_names=ServedNames.parse(values))


def two_models() -> FakeEngineClient:
    return FakeEngineClient(models=tuple(dataclasses.replace(FAKE_MODEL, name=name) for name in ("m1", "m2")))


async def ids(client: Any) -> list[str]:
    r = await client.get("/v1/models")
    assert r.status_code == 200, r.text
    return [card["id"] for card in r.json()["data"]]


async def test_names_of_the_one_model_replace_its_triton_name() -> None:
    engine = FakeEngineClient()
    async with make_client(engine, named("gpt-4o", "mine")) as client:
        data = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["root"]) for c in data] == [("gpt-4o", MODEL), ("mine", MODEL)]
        card = (await client.get("/v1/models/mine")).json()
        assert card["id"] == "mine" and card["root"] == MODEL and card["max_model_len"] == 2048
        # Any name reaches the model; every response reports the first name, as vLLM's do.
        r = await client.post("/v1/chat/completions", json={"model": "mine", **CHAT})
        assert r.status_code == 200 and r.json()["model"] == "gpt-4o"
        r = await client.post("/v1/completions", json={"model": "mine", "prompt": "x", "max_tokens": 2, "stream": True})
        chunks = parse_sse(r.text)[:-1]
        assert chunks and all(c["model"] == "gpt-4o" for c in chunks)
        assert [call.model for call in engine.calls] == [MODEL, MODEL]  # Triton sees its own name
        for name in (MODEL, "nope"):
            for r in (
                await client.post("/v1/completions", json={"model": name, "prompt": "x"}),
                await client.get(f"/v1/models/{name}"),
            ):
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
                assert f"`{name}`" in r.json()["error"]["message"]
    assert len(engine.calls) == 2


async def test_bare_names_with_several_triton_models_say_to_name_them() -> None:
    async with make_client(two_models(), named("gpt-4o")) as client:
        for r in (
            await client.get("/v1/models"),
            await client.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"}),
        ):
            assert r.status_code == 500 and "NAME=TRITON_MODEL" in r.json()["error"]["message"]


async def test_pairs_name_some_of_several_models() -> None:
    engine = two_models()
    async with make_client(engine, named("gpt=m1", "gpt-mini=m1")) as client:
        assert await ids(client) == ["gpt", "gpt-mini", "m2"]
        for name, reported in (("gpt-mini", "gpt"), ("m2", "m2")):
            r = await client.post("/v1/chat/completions", json={"model": name, **CHAT})
            assert r.status_code == 200 and r.json()["model"] == reported
        assert (await client.post("/v1/chat/completions", json={"model": "m1", **CHAT})).status_code == 404
    assert [call.model for call in engine.calls] == ["m1", "m2"]


async def test_a_served_name_hides_the_triton_model_of_that_name() -> None:
    engine = two_models()
    async with make_client(engine, named("m2=m1")) as client:
        assert await ids(client) == ["m2"]
        r = await client.post("/v1/completions", json={"model": "m2", "prompt": "x"})
        assert r.status_code == 200 and r.json()["model"] == "m2"
    assert [call.model for call in engine.calls] == ["m1"]


async def test_the_one_model_is_found_again_after_it_is_replaced() -> None:
    engine = FakeEngineClient()
    async with make_client(engine, named("gpt")) as client:
        assert await ids(client) == ["gpt"]
        engine.models = {"other": dataclasses.replace(FAKE_MODEL, name="other")}  # Triton now serves another
        assert (await client.post("/v1/completions", json={"model": "gpt", "prompt": "x"})).status_code == 404
        r = await client.post("/v1/completions", json={"model": "gpt", "prompt": "x"})
        assert r.status_code == 200 and r.json()["model"] == "gpt"
        engine.models = {"third": dataclasses.replace(FAKE_MODEL, name="third")}
        assert [(c["id"], c["root"]) for c in (await client.get("/v1/models")).json()["data"]] == [("gpt", "third")]
        assert (await client.post("/v1/completions", json={"model": "gpt", "prompt": "x"})).status_code == 200
    assert [call.model for call in engine.calls] == ["other", "third"]


async def test_tokenizer_info_without_a_model_takes_the_one_model_of_several_names() -> None:
    engine = FakeEngineClient(models=(dataclasses.replace(FAKE_MODEL, tokenizer_source="smollm2"),))
    async with make_client(engine, named("gpt", "mine")) as client:
        r = await client.get("/tokenizer_info")
    assert r.status_code == 200 and r.json()["model"] == "gpt"


def test_parse() -> None:
    assert parse_settings([]).served_names == ServedNames()
    settings = parse_settings(["--served-model-name", "gpt-4o", "org/mine", "--port", "9001"])
    assert settings.served_names.names == (("gpt-4o", None), ("org/mine", None)) and settings.port == 9001
    assert parse_settings(["--served-model-name", "a=m1", "b=m2"]).served_names.names == (("a", "m1"), ("b", "m2"))
    for values in (["a", "b=m1"], ["a", "a"], [""], ["a="], ["=m1"]):
        with pytest.raises(ValueError, match="--served-model-name"):
            ServedNames.parse(values)
        with pytest.raises(SystemExit):
            parse_settings(["--served-model-name", *values])
