"""Breaking a running server on purpose, with servers of its own (these tests kill things):
- overload past the queue bound: 503 + Retry-After at once, what is admitted is served whole; one
  request with more prompts than seats and queue is served whole;
- SIGTERM to the frontend: readiness and new requests 503 at once, short streams finish, a long one
  ends with an error event when the grace period is over;
- the engine process (the model's Python-backend stub) killed with SIGKILL mid-stream: every open
  stream ends within 10 s with an error event and [DONE], readiness (ours and Triton's model
  readiness) says not ready within 10 s, new requests get a 503 with Retry-After at once, and the
  model serves again within 90 s with nobody restarting anything;
- SIGTERM to `make serve`: no tritonserver or stub process left behind;
- an oversized body: 413 at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scripts.servers import DEFAULT_MODEL, REPO_ROOT, Frontend, copy_model_repository, free_port
from scripts.stub_supervisor import stub_processes
from tests.e2e.helpers import read_sse, running_servers
from tests.e2e.triton_stream import metric_value

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own_servers(tmp_path_factory):
    """A model repository of its own with a tight queue: 4 seats, 2 waiting sequences."""
    repository = copy_model_repository(tmp_path_factory.mktemp("repository"), max_num_seqs="4", max_waiting_seqs="2")
    with running_servers(repository, "resilience") as servers:
        yield servers


async def test_overload_past_the_queue_bound_is_refused_at_once(own_servers):
    triton, frontend = own_servers
    body = {"model": DEFAULT_MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True}
    rejected_before = metric_value(triton.metrics_url, "llm_rejected_requests_total")
    async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
        responses = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(12)))
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(served) + len(refused) == 12 and len(served) >= 4 and refused
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in served)
    for r in refused:
        assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) > 0
    deadline = time.monotonic() + 5  # (Triton publishes the counter from the engine's stats)
    while metric_value(triton.metrics_url, "llm_rejected_requests_total") - rejected_before < len(refused):
        assert time.monotonic() < deadline
        time.sleep(0.2)


async def test_a_batch_is_admitted_whole_or_refused_whole(own_servers):
    """Its prompts are admitted as one (backend/admission.py): cut part way, it would be refused and told
    to retry part of itself; waved through whole, it would overrun the queue other clients wait in."""
    triton, frontend = own_servers
    prompts = [f"Story number {i}:" for i in range(6)]  # 4 seats + 2 waiting: exactly what fits
    body = {"model": DEFAULT_MODEL, "prompt": prompts, "max_tokens": 4, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == list(range(6))
        assert r.json()["usage"]["completion_tokens"] == 24
        events, _ = await read_sse(http, {**body, "prompt": prompts[:3], "stream": True, "n": 2})
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
        finished = [c for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"] is not None]
        assert sorted(c["index"] for c in finished) == list(range(6))
        r = await http.post("/v1/completions", json={**body, "prompt": prompts * 2})  # never fits
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "needs 12 sequences" in r.json()["error"]["message"]
        r = await http.post("/v1/completions", json={**body, "prompt": prompts[0]})  # the server goes on
        assert r.status_code == 200, r.text


async def test_sigterm_drains_the_frontend(own_servers):
    triton, _ = own_servers
    frontend = Frontend(triton.grpc_url, port=free_port(), extra_args=["--shutdown-grace-s", "4"])
    frontend.start(log_path=REPO_ROOT / "artifacts" / "test-logs" / "frontend-drain.log")
    short = {"model": DEFAULT_MODEL, "prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "stream": True}
    long = {**short, "max_tokens": 2000}
    try:
        async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
            starts = [asyncio.Event() for _ in range(3)]
            streams = [
                asyncio.create_task(read_sse(http, b, s, started_after=3)) for s, b in zip(starts, (short, short, long))
            ]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)
            frontend.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            assert (await http.get("/health/ready")).status_code == 503
            r = await http.post("/v1/completions", json={**short, "stream": False})
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        for events, _ in results[:2]:  # finished within the grace period: whole, no error
            assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        events, ended = results[2]
        assert events[-1] == "[DONE]" and "shutting down" in json.loads(events[-2])["error"]["message"]
        assert 3 < ended - signalled < 10
        frontend.proc.wait(15)
    finally:
        frontend.stop()


async def test_killed_engine_process_ends_streams_and_comes_back(own_servers):
    triton, frontend = own_servers
    body = {
        "model": DEFAULT_MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=frontend.url, timeout=120) as http:
        starts = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(read_sse(http, body, s, started_after=3)) for s in starts]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 60)

        [stub] = stub_processes(triton.proc.pid)
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()

        for events, ended in await asyncio.wait_for(asyncio.gather(*streams), 30):
            assert ended - killed < 10, f"a stream ended {ended - killed:.1f} s after the kill"
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "service_unavailable_error" and "engine" in error["message"]

        deadline = killed + 10
        while (await http.get("/health/ready")).status_code != 503:
            assert time.monotonic() < deadline, "/health/ready still 200 10 s after the kill"
            await asyncio.sleep(0.2)
        model_ready = f"http://127.0.0.1:{triton.http_port}/v2/models/{DEFAULT_MODEL}/ready"
        while (await http.get(model_ready)).status_code == 200:
            assert time.monotonic() < deadline, "Triton's model readiness still 200 10 s after the kill"
            await asyncio.sleep(0.2)

        t0 = time.monotonic()
        r = await http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 2})
        if r.status_code == 503:  # (still down: it may be back already on a fast machine)
            assert time.monotonic() - t0 < 2 and int(r.headers["retry-after"]) > 0
            assert r.json()["error"]["type"] == "service_unavailable_error"

        deadline = killed + 90
        while (await http.get("/health/ready")).status_code != 200:
            assert time.monotonic() < deadline, "not serving again 90 s after the kill"
            await asyncio.sleep(0.5)
        r = await http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert len(stub_processes(triton.proc.pid)) == 1 and triton.supervisor.restarts == 1


def test_oversized_and_huge_requests_are_refused_at_once(servers):
    url = f"{servers.base_url}/completions"
    big = json.dumps({"model": servers.model, "prompt": "x" * (16 * 2**20)})
    t0 = time.monotonic()
    r = httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.monotonic() - t0 < 5
    # Under the limit but far past the context window: refused without tokenizing it all.
    t0 = time.monotonic()
    r = httpx.post(url, json={"model": servers.model, "prompt": "word " * 1_500_000}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 5
    r = httpx.post(url, json={"model": servers.model, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_sigterm_to_make_serve_leaves_no_process_behind(tmp_path):
    ports = {
        name: str(free_port())
        for name in ("FRONTEND_PORT", "TRITON_HTTP_PORT", "TRITON_GRPC_PORT", "TRITON_METRICS_PORT")
    }
    serve = subprocess.Popen(
        [sys.executable, "-m", "scripts.serve"],
        cwd=REPO_ROOT,
        env={**os.environ, **ports},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{ports['FRONTEND_PORT']}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and serve.poll() is None, "make serve did not come up"
            time.sleep(0.5)
        tritons = [pid for pid in _pids_with(f"--grpc-port={ports['TRITON_GRPC_PORT']}")]
        assert len(tritons) == 1 and stub_processes(tritons[0])
        stubs = list(stub_processes(tritons[0]))
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0
        for pid in tritons + stubs:
            assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"process {pid} left behind"
        assert not _pids_with(f"--port {ports['FRONTEND_PORT']}")
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)


def _pids_with(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" "):
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
