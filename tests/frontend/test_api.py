"""OpenAI frontend against a FakeEngineClient: the SSE output checked chunk by chunk.

Each test scripts the per-step StepOutputs the engine would send (tests/fake_engine.py)
and drives the real FastAPI app through httpx's ASGI transport (no sockets, no Triton).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import time
from typing import Any

import httpx
import pytest

from backend.coalescing import PendingResponses, join_steps
from openai_frontend.app import create_app
from openai_frontend.errors import EngineFailure, InvalidRequest
from openai_frontend.settings import Settings
from protocol import FinishReason, StepOutput, TokenLogprobs
from tests.fake_engine import FAKE_MODEL, FakeEngineClient, scripted_steps

pytestmark = pytest.mark.asyncio
MODEL = FAKE_MODEL.name


def make_client(engine: FakeEngineClient, settings: Settings | None = None) -> httpx.AsyncClient:
    app = create_app(engine, settings or Settings())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def parse_sse(text: str) -> list[Any]:
    """Every event must be `data: <json>` or `data: [DONE]`, separated by a blank line."""
    assert text.endswith("\n\n")
    events: list[Any] = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def stream(engine: FakeEngineClient, path: str, body: dict[str, Any], **kw: Any) -> list[Any]:
    async with make_client(engine, **kw) as client:
        r = await client.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        if chunk.get("choices"):
            assert len(chunk["choices"]) == 1  # one chunk per sequence step
            out.setdefault(chunk["choices"][0]["index"], []).append(chunk["choices"][0])
    return out


def script_of(steps: list[StepOutput | Exception | float]):
    return lambda prompt, params: steps


# -- the n / logprobs / usage contract ----------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
async def test_completions_n2_logprobs0_usage(max_tokens: int) -> None:
    engine = FakeEngineClient()
    events = await stream(
        engine,
        "/v1/completions",
        {
            "prompt": "one two three",
            "n": 2,
            "logprobs": 0,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
        },
    )
    *chunks, usage_chunk = events
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2 * max_tokens,
        "total_tokens": 3 + 2 * max_tokens,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert all(c["usage"] is None for c in chunks)  # OpenAI's null until the usage chunk
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1]
    for index, parts in choices.items():
        tokens = [t for p in parts for t in p["logprobs"]["tokens"]]
        assert tokens == [f"s{index}t{i} " for i in range(max_tokens)]  # every token, in order
        assert "".join(p["text"] for p in parts) == "".join(tokens)
        assert [p["finish_reason"] for p in parts] == [None] * (max_tokens - 1) + ["length"]
        # logprobs=0: the sampled token's logprob, and top_logprobs holds only it (vLLM).
        for p in parts:
            lp = p["logprobs"]
            assert lp["token_logprobs"] == [-0.5]
            assert lp["top_logprobs"] == [{lp["tokens"][0]: -0.5}]
        offsets = [o for p in parts for o in p["logprobs"]["text_offset"]]
        assert offsets == [5 * i for i in range(max_tokens)]  # characters, continuing across chunks
    assert engine.calls[0].params.n == 2 and engine.calls[0].params.logprobs == 0
    assert engine.calls[0].params.max_tokens == max_tokens


async def test_n4_finishing_in_the_same_step_keep_their_last_tokens() -> None:
    seqs = [[f"a{s}", f"b{s}", f"last{s}"] for s in range(4)]
    steps = scripted_steps(seqs, ["stop", "length", "stop", "length"], stop_reason=None)
    engine = FakeEngineClient(script_of(steps))
    events = await stream(
        engine, "/v1/completions", {"prompt": "x", "n": 4, "max_tokens": 3, "stream_options": {"include_usage": True}}
    )
    choices = by_choice(events[:-1])
    assert sorted(choices) == [0, 1, 2, 3]
    for s, parts in choices.items():
        assert "".join(p["text"] for p in parts) == f"a{s}b{s}last{s}"
        assert [p["finish_reason"] for p in parts][-1] == ("stop" if s % 2 == 0 else "length")
        assert sum(p["finish_reason"] is not None for p in parts) == 1
    assert events[-1]["usage"]["completion_tokens"] == 12


async def test_non_streaming_equals_streaming() -> None:
    body = {"model": MODEL, "prompt": ["a b", "c"], "n": 2, "max_tokens": 3, "logprobs": 2}
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        r = await client.post(
            "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        )
    events = parse_sse(r.text)[:-1]
    choices = by_choice(events)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    for c in whole["choices"]:
        parts = choices[c["index"]]
        assert c["text"] == "".join(p["text"] for p in parts)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert c["logprobs"][key] == [x for p in parts for x in p["logprobs"][key]]
        assert c["finish_reason"] == parts[-1]["finish_reason"]
        assert len(c["logprobs"]["top_logprobs"][0]) == 3  # the sampled token + 2 alternatives
    assert whole["usage"] == events[-1]["usage"]
    assert whole["object"] == "text_completion" and whole["id"].startswith("cmpl-")


async def test_batched_prompts_index_is_prompt_times_n_plus_seq() -> None:
    def script(prompt, params):
        return scripted_steps([[f"{prompt}/{s}"] for s in range(params.n)], prompt_tokens=len(prompt))

    engine = FakeEngineClient(script)
    events = await stream(
        engine, "/v1/completions", {"prompt": ["p0", "p1x", "p2yy"], "n": 2, "stream_options": {"include_usage": True}}
    )
    choices = by_choice(events[:-1])
    assert {i: parts[0]["text"] for i, parts in choices.items()} == {
        0: "p0/0",
        1: "p0/1",
        2: "p1x/0",
        3: "p1x/1",
        4: "p2yy/0",
        5: "p2yy/1",
    }
    assert events[-1]["usage"] == {
        "prompt_tokens": 2 + 3 + 4,
        "completion_tokens": 6,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert sorted(c.prompt for c in engine.calls) == ["p0", "p1x", "p2yy"]  # one engine request per prompt
    assert len({c.request_id for c in engine.calls}) == 3
    # ... which the engine's queue bound admits as one
    assert len({c.admission_group for c in engine.calls}) == 1 and engine.calls[0].admission_group.size == 3
    assert all(c.request_id.startswith(c.admission_group.key) for c in engine.calls)
    single = FakeEngineClient(script)
    await stream(single, "/v1/completions", {"prompt": "alone", "n": 2})
    assert single.calls[0].admission_group is None


async def test_cached_prompt_tokens_are_summed_over_prompts_once_each() -> None:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's): each prompt's prefix-cache hit as its first
    message says, counted once per prompt whatever n is, in every usage of chat and completions."""

    def script(prompt, params):
        text = prompt if isinstance(prompt, str) else ""
        cached = 16 if "p1" in text else 32 if "p2" in text else 0
        seqs = [[f"s{s}t{i} " for i in range(2)] for s in range(params.n)]
        return scripted_steps(seqs, prompt_tokens=40, cached_tokens=cached)

    engine = FakeEngineClient(script)
    usage = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "prompt": ["p0", "p1", "p2"], "n": 2, "max_tokens": 2}
    async with make_client(engine) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        events = parse_sse(
            (await client.post("/v1/completions", json={**body, "stream": True, "stream_options": usage})).text
        )[:-1]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "p2"}], "max_tokens": 2}
        chat_whole = (await client.post("/v1/chat/completions", json=chat)).json()
        chat_events = parse_sse(
            (await client.post("/v1/chat/completions", json={**chat, "stream": True, "stream_options": usage})).text
        )[:-1]
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 16 + 32}
    assert events[-1]["usage"] == whole["usage"]
    assert all(e["usage"]["prompt_tokens_details"]["cached_tokens"] <= 48 for e in events)
    assert chat_whole["usage"] == {
        "prompt_tokens": 40,
        "completion_tokens": 2,
        "total_tokens": 42,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert all(e["usage"]["prompt_tokens_details"] == {"cached_tokens": 32} for e in chat_events)  # the role chunk too


async def test_token_id_prompts() -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 1})
        assert r.status_code == 200
        r1 = await client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1})
    assert sorted(map(tuple, (c.prompt for c in engine.calls))) == [(1, 2), (3,), (5, 6, 7)]
    assert r1.json()["usage"]["prompt_tokens"] == 3


async def test_continuous_usage_stats() -> None:
    engine = FakeEngineClient()
    events = await stream(
        engine,
        "/v1/completions",
        {
            "prompt": "a b",
            "n": 2,
            "max_tokens": 3,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    running = [e["usage"]["completion_tokens"] for e in events[:-1]]
    assert running == list(range(1, 7))  # one token per chunk, counted as it is sent
    assert all(e["usage"]["prompt_tokens"] == 2 for e in events)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 6


async def test_continuous_usage_stats_without_include_usage_sends_no_usage() -> None:
    for path, body in [
        ("/v1/completions", {"prompt": "a b"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ]:
        events = await stream(
            FakeEngineClient(),
            path,
            {
                **body,
                "n": 2,
                "max_tokens": 3,
                "stream_options": {"include_usage": False, "continuous_usage_stats": True},
            },
        )
        assert events and all("usage" not in e for e in events) and all(e["choices"] for e in events)


async def test_include_usage_chunks_before_the_last_carry_usage_null() -> None:
    """OpenAI's streaming shape: with include_usage every chunk has `usage`, null but on the last one."""
    for path, body in [
        ("/v1/completions", {"prompt": "a b", "echo": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ]:
        base = {**body, "n": 2, "max_tokens": 3}
        *chunks, last = await stream(FakeEngineClient(), path, {**base, "stream_options": {"include_usage": True}})
        assert chunks and all(c["usage"] is None and c["choices"] for c in chunks)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        assert all("usage" not in c for c in await stream(FakeEngineClient(), path, base))


async def test_seed_outside_the_signed_64_bit_range_is_a_400() -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        for seed, status in [(2**63 - 1, 200), (-(2**63), 200), (2**63, 400), (-(2**63) - 1, 400)]:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": seed})
            assert r.status_code == status, (seed, r.text)
            if status == 400:
                assert r.json()["error"]["param"] == "seed"


async def test_unknown_fields_inside_messages_are_ignored_but_not_at_the_top() -> None:
    engine = FakeEngineClient()
    messages = [
        {"role": "user", "content": "Hi", "extra_field": 0},
        {
            "role": "assistant",
            "content": "Hello",
            "refusal": None,
            "annotations": [],
            "audio": None,
            "function_call": None,
            "reasoning_content": "thought",
        },
        {"role": "user", "content": "Again"},
    ]
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        assert "thought" not in engine.calls[0].prompt
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "extra_field": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra_field"


OPENAI_FIELDS_WITHOUT_EFFECT = {
    "store": True,
    "metadata": {"team": "search", "run": "7"},
    "service_tier": "flex",
    "prompt_cache_key": "user-42",
    "prompt_cache_retention": "24h",
    "safety_identifier": "hashed-user",
    "prediction": {"type": "content", "content": [{"type": "text", "text": "Paris"}]},
    "modalities": ["text"],
}


async def test_openai_fields_without_effect_are_accepted_and_change_nothing() -> None:
    engine = FakeEngineClient()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "seed": 3}
    async with make_client(engine) as client:
        plain = await client.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        r = await client.post("/v1/chat/completions", json={**body, **OPENAI_FIELDS_WITHOUT_EFFECT})
        assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"]
    first, second = engine.calls
    assert (second.prompt, second.params) == (first.prompt, first.params)


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata"),
        ("metadata", {"k" * 65: "v"}, "metadata"),
        ("metadata", {"k": "v" * 513}, "metadata"),
        ("metadata", {"k": 1}, "metadata.k"),
        ("modalities", ["text", "audio"], "modalities"),
        ("service_tier", "fastest", "service_tier"),
        ("prediction", {"type": "content"}, "prediction.content"),
        ("store", "maybe", "store"),
        # OpenAI's own answer for a model that does not reason / speak / search:
        ("reasoning_effort", "low", "reasoning_effort"),
        ("audio", {"voice": "alloy", "format": "wav"}, "audio"),
        ("web_search_options", {}, "web_search_options"),
    ],
)
async def test_openai_fields_out_of_reach_are_400(field, value, param) -> None:
    engine = FakeEngineClient()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: value}
    async with make_client(engine) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert engine.calls == []


async def test_chat_continuous_usage_counts_only_what_was_sent() -> None:
    engine = FakeEngineClient()
    events = await stream(
        engine,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "n": 2,
            "max_tokens": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert [e["usage"]["completion_tokens"] for e in events] == [0, 0, 1, 2, 3, 4, 4]
    assert all(e["usage"]["prompt_tokens"] == 3 for e in events)


async def test_abort_without_tokens_or_logprobs() -> None:
    steps = scripted_steps([["a", "b"]], logprobs=1)
    abort = StepOutput("r", 0, 1, (), "", None, FinishReason.ABORT, None, 5, 1, True)
    engine = FakeEngineClient(script_of([steps[0], abort]))
    async with make_client(engine) as client:
        whole = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1})).json()
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["logprobs"]["tokens"]) == ("a", "abort", ["a"])
    assert whole["usage"]["completion_tokens"] == 1


async def test_utf8_deltas_and_char_offsets() -> None:
    pieces = ["h\u00e9", "", "\U0001f600", " \u4e16"]  # "" = a token that ends mid-character
    steps = []
    for i, text in enumerate(pieces):
        steps.append(
            StepOutput(
                "r",
                0,
                i,
                (100 + i,),
                text,
                TokenLogprobs((-0.1,), (text,), ((),), ((),), ((),)),
                FinishReason.STOP if i == 3 else None,
                None,
                1,
                i + 1,
                i == 3,
            )
        )
    engine = FakeEngineClient(script_of(steps))
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True, "logprobs": 0})
        whole = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 0})).json()
    parts = by_choice(parse_sse(r.text)[:-1])[0]
    assert [p["text"] for p in parts] == pieces
    assert [p["logprobs"]["text_offset"][0] for p in parts] == [0, 2, 2, 3]
    assert whole["choices"][0]["text"] == "h\u00e9\U0001f600 \u4e16"
    assert whole["choices"][0]["finish_reason"] == "stop"


async def test_stop_reason_and_abort_reported() -> None:
    steps = scripted_steps([["a", "b"], ["c"]], ["stop", "abort"], stop_reason="b")
    engine = FakeEngineClient(script_of(steps))
    async with make_client(engine) as client:
        whole = (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2})).json()
    c0, c1 = whole["choices"]
    assert (c0["finish_reason"], c0["stop_reason"], c0["text"]) == ("stop", "b", "ab")
    assert (c1["finish_reason"], c1["stop_reason"], c1["text"]) == ("abort", None, "c")


async def test_echo() -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        whole = (
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "echo": True, "max_tokens": 2})
        ).json()
        assert whole["choices"][0]["text"] == "His0t0 s0t1 "
        # Echoing token ids needs the tokenizer, which this fake model does not name (tests/frontend/test_scoring.py
        # has one that does): a clear 501, not a wrong text.
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2], "echo": True})
        assert r.status_code == 501 and "--tokenizer" in r.json()["error"]["message"]
    events = await stream(engine, "/v1/completions", {"prompt": "Hi", "echo": True, "max_tokens": 2, "n": 2})
    choices = by_choice(events)
    assert [p["text"] for p in choices[1]] == ["His1t0 ", "s1t1 "]


# -- integrity ----------------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in metrics")


@pytest.mark.parametrize("case", ["gap", "repeat", "token_count", "unfinished"])
async def test_integrity_violation_ends_stream_with_error(case: str) -> None:
    steps = scripted_steps([["a", "b", "c"]], "length")
    if case == "gap":
        steps = [steps[0], steps[2]]
    elif case == "repeat":
        steps = [steps[0], steps[1], steps[1], steps[2]]
    elif case == "token_count":
        steps = [steps[0], dataclasses.replace(steps[1], num_output_tokens=5), steps[2]]
    else:
        steps = steps[:2]
    engine = FakeEngineClient(script_of(steps))
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 3})
        events = parse_sse(r.text)
        metrics = (await client.get("/metrics")).text
        whole = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "stream_integrity_violation" and error["type"] == "engine_error"
    texts = [e["choices"][0]["text"] for e in events[:-2]]
    expected_good = {"gap": 1, "repeat": 2, "token_count": 1, "unfinished": 2}[case]
    assert texts == ["a", "b", "c"][:expected_good]  # nothing after the violation
    assert _metric(metrics, "frontend_stream_integrity_violations_total") == 1
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "stream_integrity_violation"


async def test_coalesced_responses_give_the_same_completion() -> None:
    # A sender that fell behind joins each sequence's pending steps (backend/coalescing.py): the
    # integrity check follows the step ranges, and the client sees the same text, logprobs and usage.
    steps = scripted_steps([["a", "b", "c", "d"], ["w", "x", "y"]], "length", logprobs=2)
    pending: PendingResponses[None] = PendingResponses()
    for step in steps[:4]:  # as the sender finds them when it has fallen behind
        pending.add(None, step)
    joined = [out for _, out, _ in pending.take()] + steps[4:]
    assert any(o.num_steps > 1 for o in joined)
    body = {"prompt": "x", "n": 2, "max_tokens": 4, "logprobs": 2, "stream": False}
    results = []
    for script in (steps, joined):
        async with make_client(FakeEngineClient(script_of(script))) as client:
            r = await client.post("/v1/completions", json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
            whole = r.json()
            results.append(([(c["text"], c["logprobs"], c["finish_reason"]) for c in whole["choices"]], whole["usage"]))
    assert results[0] == results[1]
    events = await stream(FakeEngineClient(script_of(joined)), "/v1/completions", {**body, "stream": True})
    assert not any("error" in e for e in events)  # stream() checked the final [DONE]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"][0]["index"] == 0) == "abcd"


async def test_a_gap_after_a_joined_response_is_a_violation() -> None:
    steps = scripted_steps([["a", "b", "c", "d"]], "length")
    joined = join_steps(steps[:2])  # steps 0-1
    events = await stream(FakeEngineClient(script_of([joined, steps[3]])), "/v1/completions", {"prompt": "x"})
    assert events[-1]["error"]["code"] == "stream_integrity_violation"
    assert "gap before step 3 (expected 2)" in events[-1]["error"]["message"]


async def test_response_after_finish_is_a_violation() -> None:
    steps = scripted_steps([["a"], ["x", "y", "z"]])  # seq 0 finishes at step 0, seq 1 goes on
    late = dataclasses.replace(steps[0], step=1, finish_reason=None, num_output_tokens=2)
    engine = FakeEngineClient(script_of([steps[0], steps[1], late, *steps[2:]]))
    events = await stream(engine, "/v1/completions", {"prompt": "x", "n": 2})
    assert [e["choices"][0]["text"] for e in events[:-1]] == ["a", "x"]
    assert "after the sequence finished" in events[-1]["error"]["message"]


async def test_violation_cancels_the_other_prompts() -> None:
    def script(prompt, params):
        steps = scripted_steps([["a", "b", "c"]])
        return [steps[0], steps[2]] if prompt == "bad" else [steps[0], 30.0, *steps[1:]]

    engine = FakeEngineClient(script)
    events = await stream(engine, "/v1/completions", {"prompt": ["good", "bad"]})
    assert events[-1]["error"]["code"] == "stream_integrity_violation"
    # The good prompt would wait 30 s for its next step: only a cancel ends it sooner. (Polled, not slept
    # for a fixed time: on a loaded machine the cancel can take longer than a few milliseconds to land.)
    deadline = time.monotonic() + 10
    while not any(rid.endswith("-0") for rid in engine.cancelled) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert any(rid.endswith("-0") for rid in engine.cancelled)


async def test_error_mid_stream() -> None:
    steps = scripted_steps([["a", "b", "c"]])
    engine = FakeEngineClient(script_of([steps[0], EngineFailure("CUDA out of memory")]))
    events = await stream(engine, "/v1/completions", {"prompt": "x"})
    assert events[0]["choices"][0]["text"] == "a"
    assert events[1] == {
        "error": {"message": "CUDA out of memory", "type": "engine_error", "param": None, "code": None}
    }
    assert len(events) == 2


async def test_engine_refusal_before_first_token_is_an_http_error() -> None:
    engine = FakeEngineClient(script_of([InvalidRequest("prompt is longer than the context (9000 > 2048)", "prompt")]))
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "prompt is longer than the context (9000 > 2048)",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
        engine.script = script_of([EngineFailure("engine died")])
        r = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 500 and r.json()["error"]["type"] == "engine_error"


# -- chat -----------------------------------------------------------------------------------------


async def test_chat_stream_role_first_and_finish_once() -> None:
    engine = FakeEngineClient()
    events = await stream(
        engine,
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
            "n": 2,
            "max_completion_tokens": 2,
            "stream_options": {"include_usage": True},
        },
    )
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [e["choices"][0]["index"] for e in events[:2]] == [0, 1]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    choices = by_choice(events[2:-1])
    for index, parts in choices.items():
        assert all("role" not in p["delta"] for p in parts)
        assert "".join(p["delta"]["content"] for p in parts) == f"s{index}t0 s{index}t1 "
        assert [p["finish_reason"] for p in parts] == [None, "length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert engine.calls[0].prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert engine.calls[0].params.max_tokens == 2


async def test_chat_non_streaming_with_logprobs() -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "logprobs": True,
                "top_logprobs": 2,
                "max_tokens": 2,
            },
        )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "s0t0 s0t1 "}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["s0t0 ", "s0t1 "]
    assert content[0]["bytes"] == list(b"s0t0 ")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["s0t0 ~0", "s0t0 ~1"]
    assert body["usage"] == {  # fake: words of the prompt
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.calls[0].params.logprobs == 2


async def test_chat_defaults_and_rules() -> None:
    engine = FakeEngineClient()
    msgs = [{"role": "user", "content": "Hi"}]
    async with make_client(engine, Settings(chat_default_max_tokens=None)) as client:
        assert (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})).status_code == 200
        assert engine.calls[-1].params.max_tokens is None  # up to the context
        for extra, param in [
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"max_tokens": 2, "max_completion_tokens": 3}, "max_completion_tokens"),
            ({"max_completion_tokens": 0}, "max_completion_tokens"),
            ({"max_tokens": -1}, "max_tokens"),
            ({"response_format": {"type": "json_xml"}}, "response_format.type"),
            ({"tools": [{"type": "function"}]}, "tools.0.function"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"temperature": 500}, "temperature"),
        ]:
            r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, **extra})
            assert r.status_code == 400, extra
            assert r.json()["error"]["param"] == param, r.json()
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "", "content": "x"}]})
        assert r.status_code == 400 and "messages.0.role" in r.json()["error"]["message"]
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0.image_url"
        r = await client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": None}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"  # not `content.str`
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": [1.5]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.json()


# -- request validation and errors ---------------------------------------------------------------


async def test_unknown_fields_are_400_naming_them() -> None:
    async with make_client(FakeEngineClient()) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "suffix": "y", "foo": 1})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "suffix"
        assert "suffix" in error["message"] and "foo" in error["message"]
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.bogus"
        r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        error = r.json()["error"]  # the decoder's offset is not a field
        assert error["param"] is None and error["message"].startswith("The request body is not valid JSON")
        assert "at character 1" in error["message"]
        for content, content_type, hint in [
            (b"[1, 2]", "application/json", False),
            (b"null", "application/json", False),
            (b'{"model": "x", "prompt": "y"}', "application/x-www-form-urlencoded", True),  # curl -d, no -H
        ]:
            r = await client.post("/v1/completions", content=content, headers={"content-type": content_type})
            assert r.status_code == 400
            error = r.json()["error"]
            assert error["message"].startswith("The request body must be a JSON object") and error["param"] is None
            assert ("send it as application/json" in error["message"]) == hint, error
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "caf\ud800"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "ok", "stop": ["a", "b\ud83d"]}, "stop.1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
        ),
    ],
)
async def test_lone_surrogates_are_400_naming_the_field(path, body, param) -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        payload = json.dumps({"model": MODEL, **body})  # ensure_ascii: the surrogate travels as \\udXXX
        assert "\\ud" in payload
        r = await client.post(path, content=payload, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]
        assert engine.calls == []
        ok = json.dumps({"model": MODEL, **body}, ensure_ascii=False).encode("utf-8", "replace").decode("utf-8")
        assert (await client.post(path, content=ok, headers={"content-type": "application/json"})).status_code == 200


@pytest.mark.parametrize(
    "body,param",
    [
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
async def test_invalid_values_are_400(body: dict[str, Any], param: str) -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert engine.calls == []


async def test_sampling_params_reach_the_engine() -> None:
    engine = FakeEngineClient()
    async with make_client(engine) as client:
        r = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 4,
                "min_tokens": 2,
                "temperature": 0,
                "top_p": 0.9,
                "top_k": 5,
                "min_p": 0.1,
                "seed": 7,
                "stop": "END",
                "stop_token_ids": [2],
                "presence_penalty": 0.5,
                "frequency_penalty": -0.5,
                "repetition_penalty": 1.1,
                "logit_bias": {"10": -100, "3": 5},
                "ignore_eos": True,
                "include_stop_str_in_output": True,
                "allowed_token_ids": [7, 3],
                "bad_words": ["foo", "bar baz"],
                "best_of": 1,
                "user": "u1",
            },
        )
    assert r.status_code == 200, r.text
    p = engine.calls[0].params
    assert p.allowed_token_ids == (7, 3) and p.bad_words == ("foo", "bar baz")
    assert (p.max_tokens, p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (4, 2, 0.0, 0.9, 5, 0.1, 7)
    assert p.stop == ("END",) and p.stop_token_ids == (2,) and p.logit_bias == ((3, 5.0), (10, -100.0))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.ignore_eos and p.include_stop_str_in_output and p.logprobs is None


async def test_null_fields_mean_defaults() -> None:
    engine = FakeEngineClient()
    nulls = dict.fromkeys(
        [
            "n",
            "temperature",
            "top_p",
            "stop",
            "logit_bias",
            "allowed_token_ids",
            "seed",
            "stream",
            "stream_options",
            "user",
            "ignore_eos",
            "skip_special_tokens",
            "max_tokens",
        ]
    )
    async with make_client(engine) as client:
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "echo": None, "logprobs": None, "best_of": None, **nulls},
        )
        assert r.status_code == 200, r.text
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "logprobs": None,
                "top_logprobs": None,
                "max_completion_tokens": None,
                "response_format": None,
                **nulls,
            },
        )
        assert r.status_code == 200, r.text
    assert engine.calls[0].params == engine.calls[0].params.__class__(max_tokens=16)
    assert engine.calls[1].params.n == 1 and engine.calls[1].params.skip_special_tokens


async def test_default_max_tokens_flag() -> None:
    engine = FakeEngineClient()
    async with make_client(engine, Settings(default_max_tokens=5)) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert engine.calls[0].params.max_tokens == 5
    assert r.json()["usage"]["completion_tokens"] == 5


async def test_unknown_model_404_and_unreachable_503() -> None:
    async with make_client(FakeEngineClient()) as client:
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404
        assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["param"] == "model"
        assert (await client.get("/v1/models/nope")).status_code == 404
        r = await client.get("/v1/nothing")
        assert r.status_code == 404 and "error" in r.json()
    down = FakeEngineClient(available=False)
    async with make_client(down) as client:
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "x"}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}),
        ]:
            r = await client.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        assert (await client.get("/v1/models")).status_code == 503
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/health/ready")).status_code == 503
        assert (await client.get("/ping")).status_code == (await client.post("/ping")).status_code == 503


async def test_models_and_health() -> None:
    async with make_client(FakeEngineClient()) as client:
        data = (await client.get("/v1/models")).json()
        assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL]
        card = (await client.get(f"/v1/models/{MODEL}")).json()
        assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 2048
        assert (await client.get("/health/ready")).json() == {"status": "ready"}
        for r in (await client.get("/ping"), await client.post("/ping")):
            assert r.status_code == 200 and r.json() == {"status": "ready"}


async def test_api_key() -> None:
    async with make_client(FakeEngineClient(), Settings(api_key="sekrit")) as client:
        r = await client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": "Bearer wrong"}
        )
        assert r.status_code == 401
        r = await client.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 200
        assert (await client.get("/health")).status_code == (await client.get("/ping")).status_code == 200


async def test_cors() -> None:
    async with make_client(FakeEngineClient(), Settings(cors_origins=("http://ui.example",))) as client:
        r = await client.options(
            "/v1/models", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "GET"}
        )
    assert r.headers["access-control-allow-origin"] == "http://ui.example"


async def test_metrics() -> None:
    async with make_client(FakeEngineClient()) as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 3, "n": 2})
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        text = (await client.get("/metrics")).text
    assert _metric(text, 'frontend_requests_total{endpoint="/v1/completions",status="200"}') == 1
    assert _metric(text, 'frontend_requests_total{endpoint="/v1/completions",status="404"}') == 1
    assert _metric(text, "frontend_prompt_tokens_total") == 3
    assert _metric(text, "frontend_generation_tokens_total") == 6
    assert _metric(text, "frontend_time_to_first_token_seconds_count") == 1
    assert _metric(text, "frontend_inter_token_latency_seconds_count") == 4
    assert _metric(text, "frontend_requests_in_flight") == 0
    assert _metric(text, "frontend_stream_integrity_violations_total") == 0


# -- client disconnect ---------------------------------------------------------------------------


def _slow_script(prompt, params):
    steps = scripted_steps([[f"t{i}" for i in range(50)]])
    out: list[Any] = []
    for s in steps:
        out += [s, 0.02]
    return out


async def _asgi_post(app, path: str, body: dict[str, Any], disconnect_after_first_body: bool) -> list[dict[str, Any]]:
    raw = json.dumps(body).encode()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and message.get("body") and disconnect_after_first_body:
            gone.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 5000),
        "server": ("test", 80),
    }
    task = asyncio.create_task(app(scope, receive, send))
    if not disconnect_after_first_body:
        await asyncio.sleep(0.1)
        gone.set()
    await asyncio.wait_for(task, 5)
    return sent


@pytest.mark.parametrize("streaming", [True, False])
async def test_client_disconnect_cancels_engine_request(streaming: bool) -> None:
    engine = FakeEngineClient(_slow_script)
    app = create_app(engine, Settings())
    sent = await _asgi_post(
        app,
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": streaming},
        disconnect_after_first_body=streaming,
    )
    await asyncio.sleep(0.05)
    assert len(engine.calls) == 1
    assert engine.cancelled == [engine.calls[0].request_id]
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"t49" not in bodies
    metrics = app.state.metrics.render().decode()
    assert _metric(metrics, "frontend_requests_in_flight") == 0


@pytest.mark.parametrize("how", ["disconnect", "outer cancel", "ends"])
async def test_the_sse_response_closes_its_chunks_however_it_ends(how: str) -> None:
    # A disconnect ends the response quietly; a cancel from outside (server shutdown) still propagates.
    from openai_frontend.routers.common import sse_response

    closed = asyncio.Event()
    first_sent = asyncio.Event()
    gone = asyncio.Event()

    async def chunks():
        try:
            for i in range(3 if how == "ends" else 1000):
                yield {"i": i}
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        first_sent.set()

    task = asyncio.create_task(sse_response(chunks())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send))
    await asyncio.wait_for(first_sent.wait(), 5)
    if how == "disconnect":
        gone.set()
        await asyncio.wait_for(task, 5)  # returns, no exception
    elif how == "outer cancel":
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
    else:
        await asyncio.wait_for(task, 5)
        assert sent[-2]["body"] == b"data: [DONE]\n\n" and sent[-1]["more_body"] is False
    assert closed.is_set()
    bodies = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert 1 <= len(bodies) < 1000


async def test_oversized_bodies_get_413_before_parsing() -> None:
    engine = FakeEngineClient()
    async with make_client(engine, Settings(max_request_bytes=4096)) as client:
        big = json.dumps({"model": MODEL, "prompt": "x" * 5000})
        r = await client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        async def chunks():  # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000

        r = await client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 1})
        assert ok.status_code == 200
    assert len(engine.calls) == 1


async def test_draining_refuses_new_work_and_ends_what_outlives_the_grace_period() -> None:
    slow = lambda prompt, params: [x for s in scripted_steps([[f"t{i} " for i in range(50)]]) for x in (s, 0.02)]
    engine = FakeEngineClient(slow)
    app = create_app(engine, Settings(shutdown_grace_s=0.3))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:

        async def stream_events() -> list[Any]:
            r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True})
            return parse_sse(r.text)

        open_stream = asyncio.create_task(stream_events())
        while app.state.metrics.in_flight == 0:
            await asyncio.sleep(0.01)
        drain = asyncio.create_task(app.state.drain.run())
        await asyncio.sleep(0.05)
        for path in ("/health/ready", "/ping"):
            r = await client.get(path)
            assert r.status_code == 503 and r.json() == {"status": "shutting down"}
        assert (await client.get("/health")).status_code == 200
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"]
        await drain
        events = await open_stream
        assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
        assert app.state.metrics.in_flight == 0


async def test_the_startup_heap_is_frozen_out_of_the_collectors_sight():
    # (The oldest generation's collections then walk only what requests made: docs/performance.md.)
    app = create_app(FakeEngineClient())
    gc.unfreeze()
    try:
        async with app.router.lifespan_context(app):
            assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
