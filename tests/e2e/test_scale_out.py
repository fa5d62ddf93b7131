"""Scaling out on the real servers: two model instances in one tritonserver, and one frontend over two
tritonservers (one thread each) with prefix affinity, fail-over and return."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from openai_frontend.server_pool import affinity_key, rendezvous_order
from scripts.servers import (
    DEFAULT_MODEL,
    Frontend,
    TritonServer,
    copy_model_repository,
    free_port,
)
from scripts.stub_supervisor import stub_processes
from tests.e2e.helpers import LOGS, read_sse, running_servers
from tests.e2e.triton_stream import metrics, metrics_once

pytestmark = pytest.mark.slow
ONE = f"{DEFAULT_MODEL}_0_0"  # the instance label of a one-instance model


async def test_two_instances_in_one_tritonserver_both_serve_and_free_their_own_blocks(tmp_path):
    repository = copy_model_repository(tmp_path, instance_group="{ count: 2 kind: KIND_CPU }")
    with running_servers(repository, "instances") as (triton, frontend):
        assert len(stub_processes(triton.proc.pid)) == 2
        body = {"model": DEFAULT_MODEL, "max_tokens": 24, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
            responses = await asyncio.gather(
                *(http.post("/v1/completions", json={**body, "prompt": f"Story {i}:"}) for i in range(8))
            )
            assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24 for r in responses)
            generated = metrics_once(
                triton.metrics_url, "llm_generation_tokens_total", lambda g: len(g) == 2 and all(g.values())
            )
            assert len(generated) == 2 and all(v > 0 for v in generated.values()), generated  # both engines

            started = asyncio.Event()
            long = asyncio.create_task(
                read_sse(http, {**body, "prompt": "Once", "max_tokens": 2000, "stream": True}, started)
            )
            await asyncio.wait_for(started.wait(), 60)
            deadline = time.monotonic() + 10
            while not (busy := [i for i, v in metrics(triton.metrics_url, "llm_kv_blocks_used").items() if v > 0]):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
            aborted = metrics(triton.metrics_url, "llm_aborted_requests_total")
            long.cancel()  # the client goes away
            await asyncio.gather(long, return_exceptions=True)
        deadline = time.monotonic() + 15
        while metrics(triton.metrics_url, "llm_kv_blocks_used")[busy[0]] > 0:
            assert time.monotonic() < deadline, "the engine that ran the cancelled request kept its blocks"
            await asyncio.sleep(0.2)
        want = aborted.get(busy[0], 0) + 1
        after = metrics_once(triton.metrics_url, "llm_aborted_requests_total", lambda a: a.get(busy[0]) == want)
        assert after[busy[0]] == want  # aborted in the engine that ran it


def prompts_preferring(url: str, urls: list[str], count: int, prefix: str = "") -> list[str]:
    found = (f"{prefix}Question {i}: tell me something." for i in range(10_000))
    return [p for p in found if rendezvous_order(affinity_key(p), urls)[0] == url][:count]


async def test_one_frontend_over_two_tritonservers(tmp_path):
    repo = copy_model_repository(tmp_path, num_threads="1")
    tritons = [
        TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), model_repository=repo)
        for _ in range(2)
    ]
    for i, t in enumerate(tritons):
        t.start(log_path=LOGS / f"tritonserver-pool-{i}.log")
    urls = [t.grpc_url for t in tritons]
    frontend = Frontend(urls[0], port=free_port(), extra_args=["--triton-url", urls[1]])
    try:
        frontend.start(log_path=LOGS / "frontend-pool.log")
        body = {"model": DEFAULT_MODEL, "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [DEFAULT_MODEL]
            # Requests reach both servers, each where its prompt hashes.
            for t, url in zip(tritons, urls):
                before = metrics(t.metrics_url, "llm_prompt_tokens_total")[f"{DEFAULT_MODEL}_0_0"]
                for prompt in prompts_preferring(url, urls, 2):
                    assert (await http.post("/v1/completions", json={**body, "prompt": prompt})).status_code == 200
                after = metrics_once(t.metrics_url, "llm_prompt_tokens_total", lambda m, b=before: m.get(ONE, 0) > b)
                assert after[ONE] > before

            # A long shared prefix: both requests on one server, whose prefix cache then hits.
            system = "You are a careful assistant who answers in one short sentence. " * 12
            for question in ("What is the capital of Italy?", "What is the largest ocean?"):
                assert (
                    await http.post("/v1/completions", json={**body, "prompt": system + question})
                ).status_code == 200
            home = urls.index(rendezvous_order(affinity_key(system + "x"), urls)[0])
            hits = metrics_once(tritons[home].metrics_url, "llm_prefix_cache_hit_ratio", lambda m: m.get(ONE, 0) > 0)
            assert hits[ONE] > 0

            # SIGKILL one server mid-stream: its streams end with an error event; every next request succeeds.
            victim = tritons[0]
            started = asyncio.Event()
            prompt = prompts_preferring(urls[0], urls, 1)[0]
            doomed = asyncio.create_task(
                read_sse(
                    http, {**body, "prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}, started
                )
            )
            await asyncio.wait_for(started.wait(), 60)
            os.killpg(victim.proc.pid, signal.SIGKILL)
            events, _ = await asyncio.wait_for(doomed, 30)
            assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
            for p in prompts_preferring(urls[0], urls, 4) + prompts_preferring(urls[1], urls, 2):
                r = await http.post("/v1/completions", json={**body, "prompt": p})
                assert r.status_code == 200, r.text
            assert (await http.get("/health/ready")).status_code == 200

            # Back: it gets its traffic again.
            victim.proc.wait(10)
            victim.start(log_path=LOGS / "tritonserver-pool-0-again.log")
            deadline = time.monotonic() + 60
            while True:
                for p in prompts_preferring(urls[0], urls, 2, prefix=f"{time.monotonic()} "):
                    assert (await http.post("/v1/completions", json={**body, "prompt": p})).status_code == 200
                if metrics(victim.metrics_url, "llm_prompt_tokens_total").get(f"{DEFAULT_MODEL}_0_0", 0) > 0:
                    break
                assert time.monotonic() < deadline, "the restarted server got no traffic"
                await asyncio.sleep(1)
    finally:
        frontend.stop()
        for t in tritons:
            t.stop()
