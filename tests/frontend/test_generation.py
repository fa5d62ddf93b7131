"""Generation's two ways of reading the engine: one prompt read in the request's own task, several
prompts read by a task each and merged. Both must give the same checked stream, turn any client failure
into an EngineFailure, and close every engine stream they leave early."""

from __future__ import annotations

import asyncio

import pytest

from openai_frontend.errors import EngineFailure, StreamIntegrityError
from openai_frontend.generation import Generation
from openai_frontend.metrics import Metrics
from protocol import SamplingParams
from tests.fake_engine import FAKE_MODEL, FakeEngineClient, scripted_steps

pytestmark = pytest.mark.asyncio


def generation(engine: FakeEngineClient, prompts: list[str], **params) -> Generation:
    return Generation(engine, FAKE_MODEL.name, prompts, SamplingParams(**params), "req", Metrics())


async def collect(gen: Generation) -> list[tuple[int, int, int, str]]:
    return [(p, out.seq_index, out.step, out.text_delta) async for p, out in gen.events()]


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])
async def test_every_step_of_every_sequence_in_order(prompts: list[str]) -> None:
    gen = generation(FakeEngineClient(), prompts, n=2, max_tokens=3)
    events = await collect(gen)
    for p in range(len(prompts)):
        for seq in range(2):
            mine = [(step, text) for q, s, step, text in events if (q, s) == (p, seq)]
            assert mine == [(i, f"s{seq}t{i} ") for i in range(3)]
    assert gen.usage.completion_tokens == 6 * len(prompts)


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])
async def test_a_client_bug_becomes_an_engine_failure(prompts: list[str]) -> None:
    steps = scripted_steps([["x ", "y ", "z "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], RuntimeError("boom")])
    with pytest.raises(EngineFailure, match="engine client failed: RuntimeError: boom"):
        await collect(generation(engine, prompts, max_tokens=3))


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])
async def test_a_violation_closes_every_engine_stream(prompts: list[str]) -> None:
    steps = scripted_steps([["x ", "y ", "z ", "w "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], steps[2], 10.0, steps[3]])  # step 1 missing
    with pytest.raises(StreamIntegrityError, match="gap before step 2"):
        await collect(generation(engine, prompts, max_tokens=4))
    await asyncio.sleep(0)
    assert sorted(engine.cancelled) == sorted(f"req-{p}" for p in range(len(prompts)))


@pytest.mark.parametrize("prompts", [["a"], ["a", "b"]])
async def test_a_consumer_that_stops_early_closes_the_engine_streams(prompts: list[str]) -> None:
    steps = scripted_steps([["x ", "y "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0], 10.0, steps[1]])
    events = generation(engine, prompts, max_tokens=2).events()
    await anext(events)
    await events.aclose()
    assert sorted(engine.cancelled) == sorted(f"req-{p}" for p in range(len(prompts)))


async def test_an_engine_request_that_ends_early_is_a_violation() -> None:
    steps = scripted_steps([["x ", "y "]])
    engine = FakeEngineClient(lambda prompt, params: [steps[0]])  # ends without finishing its sequence
    with pytest.raises(StreamIntegrityError, match="ended before the sequence finished"):
        await collect(generation(engine, ["a"], max_tokens=2))
