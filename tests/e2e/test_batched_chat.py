"""Batched chat end to end (vLLM's: `messages` as a list of conversations): raw HTTP -> frontend -> real
tritonserver -> engine. Greedy, each conversation's choice is what the conversation gets alone."""

from __future__ import annotations

import httpx
import pytest

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Say hello."}],
]


@pytest.fixture(scope="module")
def http(servers):
    with httpx.Client(base_url=servers.base_url, timeout=120) as client:
        yield client


def test_a_greedy_batch_equals_each_conversation_alone(http, servers):
    body = {"model": servers.model, "max_tokens": 12, "temperature": 0}
    r = http.post("/chat/completions", json={**body, "messages": CONVERSATIONS})
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    alone = [http.post("/chat/completions", json={**body, "messages": m}).json() for m in CONVERSATIONS]
    for i, single in enumerate(alone):
        assert batch["choices"][i]["message"] == single["choices"][0]["message"]
        assert batch["choices"][i]["finish_reason"] == single["choices"][0]["finish_reason"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][field] == sum(single["usage"][field] for single in alone)
    assert "Paris" in batch["choices"][0]["message"]["content"]


def test_a_streamed_batch_is_a_400_and_vllms_route_serves_batches(http, servers):
    body = {"model": servers.model, "max_tokens": 2, "messages": CONVERSATIONS[:2]}
    r = http.post("/chat/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    r = http.post("/chat/completions/batch", json=body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
