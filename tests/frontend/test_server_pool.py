"""ServerPool over fake Triton clients: prefix affinity, the busy fallback, fail-over before the first
token (and none after it), ejection and return, the merged model list, DNS discovery, metrics."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import generate_latest

from openai_frontend import server_pool
from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import EngineUnavailable, ModelNotFound
from openai_frontend.server_pool import ServerPool, affinity_key, rendezvous_order
from protocol import SamplingParams, StepOutput, Task
from tests.fake_engine import scripted_steps

pytestmark = pytest.mark.asyncio


class _Watchdog:
    def __init__(self) -> None:
        self.down: set[str] = set()

    def is_down(self, model: str) -> bool:
        return model in self.down


class FakeServer:
    """What ServerPool uses of a TritonEngineClient."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.watchdog = _Watchdog()
        self.models = ["llm"]
        self.prompts: list[object] = []
        self.refuse = False  # unreachable: fails before any output
        self.break_after_first = False
        self.is_ready = True
        self.hold: asyncio.Event | None = None

    async def ready(self) -> bool:
        return self.is_ready

    async def list_models(self) -> list[ModelInfo]:
        if self.refuse:
            raise EngineUnavailable(f"{self.url} unreachable")
        return [ModelInfo(m) for m in self.models]

    async def model_config(self, model: str) -> ModelInfo:
        if self.refuse:
            raise EngineUnavailable(f"{self.url} unreachable")
        if model not in self.models:
            raise ModelNotFound(model)
        return ModelInfo(model)

    async def generate(
        self,
        model: str,
        prompt,
        params: SamplingParams,
        request_id: str,
        admission_group=None,
        task=Task.GENERATE,
        headers=None,
    ) -> AsyncIterator[StepOutput]:
        if self.refuse:
            raise EngineUnavailable(f"{self.url} unreachable")
        self.prompts.append(prompt)
        for i, step in enumerate(scripted_steps([["a", "b"]])):
            if i == 1 and self.break_after_first:
                raise EngineUnavailable(f"{self.url} died")
            if self.hold is not None:
                await self.hold.wait()
            yield step

    def abort_all(self, reason: str) -> int:
        return 0

    async def close(self) -> None:
        pass


def pool_of(*urls: str, resolve=None) -> tuple[ServerPool, dict[str, FakeServer]]:
    servers: dict[str, FakeServer] = {}

    def make(url: str) -> FakeServer:
        servers[url] = FakeServer(url)
        return servers[url]

    return ServerPool(urls, make_client=make, resolve=resolve or (lambda url: [url])), servers


async def run(pool: ServerPool, prompt) -> list[StepOutput]:
    return [out async for out in pool.generate("llm", prompt, SamplingParams(), "r")]


async def test_prompts_sharing_a_prefix_share_a_server_and_others_spread() -> None:
    pool, servers = pool_of("a:1", "b:1", "c:1")
    system = "You are a helpful assistant. " * 30  # longer than the affinity prefix
    for question in ("What is 2+2?", "Name a color.", "Hello!"):
        await run(pool, system + question)
    assert sorted(len(s.prompts) for s in servers.values()) == [0, 0, 3]
    for i in range(30):
        await run(pool, f"prompt number {i}")
    assert all(s.prompts for s in servers.values())
    ids = list(range(200))
    await run(pool, ids)
    await run(pool, ids[:150] + [7, 7, 7])
    assert sum(ids in s.prompts and ids[:150] + [7, 7, 7] in s.prompts for s in servers.values()) == 1
    assert (
        rendezvous_order(affinity_key("x"), ["a:1", "b:1"])[0] == rendezvous_order(affinity_key("x"), ["b:1", "a:1"])[0]
    )


async def test_a_much_busier_preferred_server_yields_to_the_idlest() -> None:
    pool, servers = pool_of("a:1", "b:1")
    prompt = "same prefix every time"
    preferred = rendezvous_order(affinity_key(prompt), ["a:1", "b:1"])[0]
    other = "b:1" if preferred == "a:1" else "a:1"
    servers[preferred].hold = asyncio.Event()
    held = [asyncio.create_task(run(pool, prompt)) for _ in range(4)]
    await asyncio.sleep(0.05)
    assert len(servers[preferred].prompts) == 4  # affinity holds while the gap is small...
    await run(pool, prompt)
    assert len(servers[other].prompts) == 1  # ...not once it is BUSY_MARGIN requests
    servers[preferred].hold.set()
    await asyncio.gather(*held)


async def test_fail_over_before_the_first_token_ejection_and_return(monkeypatch) -> None:
    monkeypatch.setattr(server_pool, "CHECK_INTERVAL_S", 0.02)
    pool, servers = pool_of("a:1", "b:1")
    servers["a:1"].refuse, servers["a:1"].is_ready = True, False
    prefer_a = [
        p for p in (f"p{i}" for i in range(100)) if rendezvous_order(affinity_key(p), ["a:1", "b:1"])[0] == "a:1"
    ]
    for prompt in prefer_a[:6]:
        assert len(await run(pool, prompt)) == 2  # every request served, by b
    assert len(servers["b:1"].prompts) == 6
    assert pool._servers["a:1"].ejected
    servers["a:1"].refuse = False
    servers["a:1"].is_ready = True
    await asyncio.sleep(0.1)
    assert not pool._servers["a:1"].ejected
    for i in range(20):
        await run(pool, f"q{i}")
    assert servers["a:1"].prompts  # traffic again
    metrics = generate_latest(pool.registry).decode()
    assert 'frontend_server_failures_total{server="a:1"}' in metrics
    assert 'frontend_server_routed_total{server="b:1"}' in metrics
    await pool.close()


async def test_a_stream_that_breaks_midway_is_not_answered_twice() -> None:
    pool, servers = pool_of("a:1", "b:1")
    for s in servers.values():
        s.break_after_first = True
    seen = []
    with pytest.raises(EngineUnavailable, match="died"):
        async for out in pool.generate("llm", "x", SamplingParams(), "r"):
            seen.append(out)
    assert len(seen) == 1 and sum(len(s.prompts) for s in servers.values()) == 1


async def test_down_models_models_union_and_not_found() -> None:
    pool, servers = pool_of("a:1", "b:1")
    servers["a:1"].models = ["llm", "other"]
    assert [m.name for m in await pool.list_models()] == ["llm", "other"]
    servers["b:1"].watchdog.down.add("llm")
    for i in range(5):
        await run(pool, f"p{i}")
    assert not servers["b:1"].prompts
    assert (await pool.model_config("other")).name == "other"
    with pytest.raises(ModelNotFound):
        await pool.model_config("nope")
    servers["a:1"].refuse = servers["b:1"].refuse = True
    with pytest.raises(EngineUnavailable):
        await pool.model_config("nope")
    with pytest.raises(EngineUnavailable, match="no Triton server"):
        await run(pool, "x")


async def test_a_name_with_several_addresses_is_one_server_per_address() -> None:
    addresses = {"triton.svc:8001": ["10.0.0.1:8001", "10.0.0.2:8001"]}
    pool, servers = pool_of("triton.svc:8001", resolve=lambda url: addresses[url])
    await pool.list_models()
    assert sorted(pool._servers) == ["10.0.0.1:8001", "10.0.0.2:8001"]
    assert server_pool.resolve_url("127.0.0.1:8001") == ["127.0.0.1:8001"]
    assert server_pool.resolve_url("localhost:8001") == ["localhost:8001"]
