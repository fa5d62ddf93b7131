"""The frontend's end-to-end request latency: one observation per generation request when its engine
work ends (finished, failed or given up by the client), from the request's arrival."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_frontend.app import create_app
from openai_frontend.errors import EngineFailure
from openai_frontend.generation import Generation
from openai_frontend.metrics import Metrics
from openai_frontend.settings import Settings
from protocol import SamplingParams
from tests.fake_engine import FAKE_MODEL, FakeEngineClient, scripted_steps

E2E = "frontend_e2e_request_latency_seconds"


def e2e(metrics: Metrics) -> tuple[float, float]:
    """(count, sum) of the end-to-end histogram."""
    [family] = [f for f in metrics.registry.collect() if f.name == E2E]
    samples = {s.name: s.value for s in family.samples}
    return samples[f"{E2E}_count"], samples[f"{E2E}_sum"]


async def drain(gen: Generation) -> None:
    async for _ in gen.events():
        pass


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])
async def test_one_observation_per_request_from_its_arrival(prompts: list[str]) -> None:
    steps = scripted_steps([["x ", "y "], ["u ", "v "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], steps[1], 0.05, steps[2], steps[3]])
    metrics = Metrics()
    arrival = time.monotonic() - 0.2  # the request arrived before its prompt was tokenized
    gen = Generation(engine, FAKE_MODEL.name, prompts, SamplingParams(n=2, max_tokens=2), "req", metrics, arrival)
    assert e2e(metrics) == (0, 0)
    await drain(gen)
    count, total = e2e(metrics)
    assert count == 1  # one request, whatever its prompts and sequences
    assert 0.25 <= total < 5


async def test_a_failed_request_is_observed_too() -> None:
    steps = scripted_steps([["x ", "y "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], RuntimeError("boom")])
    metrics = Metrics()
    gen = Generation(engine, FAKE_MODEL.name, ["a"], SamplingParams(max_tokens=2), "req", metrics)
    with pytest.raises(EngineFailure):
        await drain(gen)
    assert e2e(metrics)[0] == 1


async def test_a_stream_closed_early_is_observed_once() -> None:
    steps = scripted_steps([["x ", "y "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], 10.0, steps[1]])
    metrics = Metrics()
    events = Generation(engine, FAKE_MODEL.name, ["a"], SamplingParams(max_tokens=2), "req", metrics).events()
    await anext(events)
    await events.aclose()  # the client went away
    assert e2e(metrics)[0] == 1


async def test_served_at_metrics_for_generation_requests_only() -> None:
    app = create_app(FakeEngineClient(), Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        r = await client.post("/v1/completions", json={"model": FAKE_MODEL.name, "prompt": "a b", "max_tokens": 3})
        assert r.status_code == 200
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})  # 404: no engine work
        await client.get("/v1/models")
        text = (await client.get("/metrics")).text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == E2E]
    assert family.type == "histogram"
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[(f"{E2E}_count", None)] == 1
    assert samples[(f"{E2E}_bucket", "+Inf")] == 1
