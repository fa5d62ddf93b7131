"""Scoring and vLLM's request surface in the frontend, against a FakeEngineClient whose model names
the real SmolLM2 tokenizer: echo with logprobs (lm-eval's loglikelihood request), max_tokens 0,
prompt_logprobs, return_token_ids, return_tokens_as_token_ids, the tokenizer endpoints, chat's
template controls, /invocations and /version.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from protocol import PromptLogprobs, SamplingParams
from tests.fake_engine import CHATML_TEMPLATE, FAKE_MODEL, FakeEngineClient, default_script
from tests.frontend.test_api import by_choice, make_client, stream
from tokenization.model_files import load_tokenizer

pytestmark = pytest.mark.asyncio
TOKENIZER = load_tokenizer("smollm2")
SCORED = dataclasses.replace(FAKE_MODEL, tokenizer_source="smollm2")
MODEL = SCORED.name


def fake_prompt_logprobs(ids: list[int], k: int) -> PromptLogprobs:
    """Made-up but well-formed scores of a real tokenization (the engine's are tested in test_prompt_logprobs)."""
    tops = [tuple((t + j) % TOKENIZER.vocab_size for j in range(k)) for t in ids[1:]]
    return PromptLogprobs(
        token_ids=tuple(ids),
        token_texts=tuple(TOKENIZER.token_text(t) for t in ids),
        logprobs=tuple(-0.5 * (i + 1) for i in range(len(ids) - 1)),
        ranks=tuple(1 + i % 3 for i in range(len(ids) - 1)),
        top_token_ids=tuple(tops),
        top_logprobs=tuple(tuple(-0.25 * (j + 1) for j in range(k)) for _ in tops),
        top_token_texts=tuple(tuple(TOKENIZER.token_text(t) for t in top) for top in tops),
    )


def scoring_script(prompt: str | list[int], params: SamplingParams) -> list[Any]:
    ids = list(prompt) if isinstance(prompt, list) else TOKENIZER.encode(prompt)
    steps = [dataclasses.replace(s, num_prompt_tokens=len(ids)) for s in default_script(prompt, params)]
    if params.prompt_logprobs is not None:
        pl = fake_prompt_logprobs(ids, params.prompt_logprobs)
        steps = [dataclasses.replace(s, prompt_logprobs=pl) if s.step == 0 else s for s in steps]
    return steps


def engine() -> FakeEngineClient:
    return FakeEngineClient(scoring_script, models=(SCORED,))


async def post(eng: FakeEngineClient, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    async with make_client(eng) as client:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


# -- completions: echo, logprobs of the prompt, max_tokens 0 ---------------------------------------


async def test_echo_with_logprobs_scores_the_prompt_like_openai_legacy() -> None:
    eng = engine()
    body = await post(
        eng,
        "/v1/completions",
        {"model": MODEL, "prompt": "The cat sat", "echo": True, "logprobs": 1, "max_tokens": 2, "temperature": 0},
    )
    assert eng.calls[0].params.prompt_logprobs == 1 and eng.calls[0].params.max_tokens == 2
    ids = TOKENIZER.encode("The cat sat")
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "The cat sat" + "s0t0 s0t1 "
    assert lp["tokens"] == [TOKENIZER.token_text(t) for t in ids] + ["s0t0 ", "s0t1 "]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == [-0.5 * (i + 1) for i in range(len(ids) - 1)]
    assert lp["top_logprobs"][1] == {TOKENIZER.token_text(ids[1]): -0.5}  # its one alternative is itself
    texts = [TOKENIZER.token_text(t) for t in ids] + ["s0t0 ", "s0t1 "]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 2,
        "total_tokens": len(ids) + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_lm_eval_loglikelihood_request_with_token_id_prompts() -> None:
    """lm-eval's payload: token-id prompts, echo, logprobs 1, max_tokens 1, temperature 0."""
    eng = engine()
    prompts = [TOKENIZER.encode("Paris is the capital of France"), TOKENIZER.encode("2 + 2 = 4")]
    body = await post(
        eng,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": prompts,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 1,
            "temperature": 0,
            "seed": 1234,
        },
    )
    for i, ids in enumerate(prompts):
        choice = body["choices"][i]
        assert choice["index"] == i and choice["text"].startswith(TOKENIZER.decode(ids, skip_special_tokens=False))
        token_logprobs = choice["logprobs"]["token_logprobs"]
        assert len(token_logprobs) == len(ids) + 1  # the prompt, then the one generated token
        ctxlen = 2  # what lm-eval sums: the continuation's tokens
        assert sum(token_logprobs[ctxlen:-1]) == sum(-0.5 * j for j in range(ctxlen, len(ids)))


async def test_max_tokens_zero_with_echo_returns_the_scored_prompt_only() -> None:
    eng = engine()
    body = await post(
        eng, "/v1/completions", {"model": MODEL, "prompt": "Hello world", "echo": True, "logprobs": 0, "max_tokens": 0}
    )
    assert eng.calls[0].params.max_tokens == 1  # the engine runs one step; none of it is shown
    ids = TOKENIZER.encode("Hello world")
    choice = body["choices"][0]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [TOKENIZER.token_text(t) for t in ids]
    assert body["usage"]["completion_tokens"] == 0
    events = await stream(
        engine(),
        "/v1/completions",
        {"prompt": "Hello world", "echo": True, "max_tokens": 0, "stream_options": {"include_usage": True}},
    )
    assert "".join(c["choices"][0]["text"] for c in events if c["choices"]) == "Hello world"
    assert events[-1]["usage"]["completion_tokens"] == 0
    error = await post(engine(), "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400)
    assert error["error"]["param"] == "max_tokens"


async def test_streamed_echo_with_logprobs_equals_the_whole_response() -> None:
    body = {"prompt": ["one two", "three"], "echo": True, "logprobs": 2, "max_tokens": 3, "n": 2}
    whole = await post(engine(), "/v1/completions", {"model": MODEL, **body})
    choices = by_choice(await stream(engine(), "/v1/completions", body))
    assert sorted(choices) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        parts = choices[choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"]
        joined = {key: [v for p in parts for v in p["logprobs"][key]] for key in choice["logprobs"]}
        assert joined == choice["logprobs"]


async def test_prompt_logprobs_in_vllm_shape() -> None:
    eng = engine()
    body = await post(
        eng, "/v1/completions", {"model": MODEL, "prompt": "a b c", "prompt_logprobs": 2, "max_tokens": 1, "n": 2}
    )
    ids = TOKENIZER.encode("a b c")
    for choice in body["choices"]:
        pl = choice["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        entry = pl[1]
        assert entry[str(ids[1])] == {"logprob": -0.5, "rank": 1, "decoded_token": TOKENIZER.token_text(ids[1])}
        assert entry[str(ids[1] + 1)]["rank"] == 2  # the second alternative (the first is the token itself)
    chat = await post(
        engine(),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0, "max_tokens": 1},
    )
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    for path, extra in (
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        error = await post(engine(), path, {"model": MODEL, "prompt_logprobs": 1, "stream": True, **extra}, 400)
        assert error["error"]["param"] == "prompt_logprobs"
        error = await post(engine(), path, {"model": MODEL, "prompt_logprobs": 21, **extra}, 400)
        assert "prompt_logprobs" in error["error"]["param"]


async def test_vllms_fields_are_null_when_not_asked_for_and_absent_from_chunks() -> None:
    """vLLM's non-streamed shapes: prompt_logprobs, prompt_token_ids and token_ids are null unless asked
    for (its clients read them as attributes); a streamed chunk carries only those it has."""
    completion = await post(engine(), "/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2})
    choice = completion["choices"][0]
    assert (choice["prompt_logprobs"], choice["prompt_token_ids"], choice["token_ids"]) == (None, None, None)
    chat = await post(
        engine(),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    )
    assert (chat["prompt_logprobs"], chat["prompt_token_ids"], chat["choices"][0]["token_ids"]) == (None, None, None)
    for event in await stream(engine(), "/v1/completions", {"prompt": "a b", "max_tokens": 2}):
        for c in event["choices"]:
            assert not {"prompt_logprobs", "prompt_token_ids", "token_ids"} & set(c)


# -- token ids ----------------------------------------------------------------------------------


async def test_return_token_ids_sends_the_prompt_as_ids_and_returns_both() -> None:
    eng = engine()
    body = await post(
        eng, "/v1/completions", {"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "return_token_ids": True}
    )
    ids = TOKENIZER.encode("Hello there")
    assert eng.calls[0].prompt == ids  # the ids returned are the ones the engine ran
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 2
    events = await stream(
        engine(), "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, "return_token_ids": True}
    )
    parts = by_choice(events)[0]
    assert parts[0]["prompt_token_ids"] == ids and "prompt_token_ids" not in parts[1]
    assert [t for p in parts for t in p["token_ids"]] == choice["token_ids"]
    chat = await post(
        engine(),
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "return_token_ids": True},
    )
    assert chat["prompt_token_ids"] == TOKENIZER.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert len(chat["choices"][0]["token_ids"]) == 2


async def test_truncate_prompt_tokens_keeps_the_last_tokens() -> None:
    text = "one two three four five six seven eight"
    ids = TOKENIZER.encode(text)
    eng = engine()
    body = await post(
        eng,
        "/v1/completions",
        {"model": MODEL, "prompt": [text, "short"], "max_tokens": 2, "truncate_prompt_tokens": 3, "echo": True},
    )
    assert eng.calls[0].prompt == ids[-3:] and eng.calls[1].prompt == "short"  # a prompt that fits stays text
    echoed = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert echoed[0].startswith(TOKENIZER.decode(ids[-3:])) and echoed[1].startswith("short")
    assert body["usage"]["prompt_tokens"] == 3 + len(TOKENIZER.encode("short"))
    eng = engine()
    await post(eng, "/v1/completions", {"model": MODEL, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert eng.calls[0].prompt == ids  # -1: the context window, which holds it
    eng = engine()
    messages = [{"role": "user", "content": text}]
    await post(eng, "/v1/chat/completions", {"model": MODEL, "messages": messages, "truncate_prompt_tokens": 4})
    rendered = TOKENIZER.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
    assert eng.calls[0].prompt == rendered[-4:]
    for bad in (0, -2, SCORED.max_model_len + 1):
        eng = engine()
        error = await post(
            eng, "/v1/completions", {"model": MODEL, "prompt": text, "truncate_prompt_tokens": bad}, status=400
        )
        assert error["error"]["param"] == "truncate_prompt_tokens" and eng.calls == []


async def test_return_tokens_as_token_ids_names_every_token_by_id() -> None:
    body = await post(
        engine(),
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 2,
            "logprobs": 1,
            "echo": True,
            "return_tokens_as_token_ids": True,
        },
    )
    lp = body["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert lp["tokens"][0] == f"token_id:{TOKENIZER.encode('Hi')[0]}"
    assert all(key.startswith("token_id:") for entry in lp["top_logprobs"][1:] for key in entry)
    chat = await post(
        engine(),
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "logprobs": True,
            "top_logprobs": 1,
            "return_tokens_as_token_ids": True,
        },
    )
    content = chat["choices"][0]["logprobs"]["content"][0]
    assert content["token"].startswith("token_id:") and content["top_logprobs"][0]["token"].startswith("token_id:")


# -- tokenizer endpoints ----------------------------------------------------------------------------


async def test_tokenize_detokenize_and_tokenizer_info() -> None:
    eng = engine()
    text = "Hello, world! <|im_end|>"
    body = await post(eng, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    assert body["tokens"] == TOKENIZER.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == SCORED.max_model_len
    assert body["token_strs"] == [TOKENIZER.token_text(t) for t in body["tokens"]]
    assert (await post(eng, "/tokenize", {"prompt": "test", "add_special_tokens": False}))[
        "tokens"
    ] == TOKENIZER.encode("test")  # model left out: the one served
    chat = await post(eng, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["tokens"] == TOKENIZER.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert (await post(eng, "/detokenize", {"tokens": body["tokens"]}))["prompt"] == text
    error = await post(eng, "/detokenize", {"tokens": [TOKENIZER.vocab_size]}, 400)
    assert error["error"]["param"] == "tokens" and str(TOKENIZER.vocab_size) in error["error"]["message"]
    error = await post(eng, "/tokenize", {"prompt": "x", "bogus": 1}, 400)
    assert error["error"]["param"] == "bogus"
    error = await post(eng, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": []}, 400)
    assert error["error"]["param"] == "tools"
    async with make_client(eng) as client:
        info = (await client.get("/tokenizer_info")).json()
        assert (await client.get("/tokenizer_info", params={"model": "nope"})).status_code == 404
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == CHATML_TEMPLATE
    assert info["model_max_length"] == SCORED.max_model_len and info["vocab_size"] == TOKENIZER.vocab_size


# -- chat template controls, routes -------------------------------------------------------------------


async def test_chat_template_controls() -> None:
    eng = engine()
    msgs = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi the"}]
    body = await post(
        eng,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 2,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert eng.calls[0].prompt == "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nHi the"
    assert body["choices"][0]["message"]["content"] == "Hi the" + "s0t0 s0t1 "
    await post(
        eng,
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs[:1], "max_tokens": 1, "add_generation_prompt": False},
    )
    assert eng.calls[1].prompt == "<|im_start|>user\nSay hi<|im_end|>\n"
    error = await post(
        eng, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "continue_final_message": True}, 400
    )
    assert error["error"]["param"] == "continue_final_message"
    await post(
        eng,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "robot", "content": "beep"}, {"role": "developer", "content": "be kind"}],
        },
    )
    assert eng.calls[2].prompt.startswith("<|im_start|>robot\nbeep<|im_end|>\n<|im_start|>system\nbe kind")
    kwargs_model = dataclasses.replace(SCORED, chat_template="{{ greeting }} {{ messages[0]['content'] }}")
    eng = FakeEngineClient(scoring_script, models=(kwargs_model,))
    await post(
        eng,
        "/v1/chat/completions",
        {"model": MODEL, "messages": msgs[:1], "max_tokens": 1, "chat_template_kwargs": {"greeting": "Hello"}},
    )
    assert eng.calls[0].prompt == "Hello Say hi"
    stream_events = await stream(
        engine(),
        "/v1/chat/completions",
        {
            "messages": msgs,
            "max_tokens": 1,
            "echo": True,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in stream_events) == "Hi thes0t0 "


async def test_invocations_dispatch_and_version() -> None:
    eng = engine()
    chat = await post(
        eng, "/invocations", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    )
    assert chat["object"] == "chat.completion"
    completion = await post(eng, "/invocations", {"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert completion["object"] == "text_completion"
    error = await post(eng, "/invocations", {"model": MODEL}, 400)
    assert error["error"]["type"] == "invalid_request_error"
    error = await post(eng, "/invocations", {"model": MODEL, "prompt": "x", "nonsense": 1}, 400)
    assert error["error"]["param"] == "nonsense"
    async with make_client(eng) as client:
        r = await client.post("/invocations", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream") and r.text.endswith("data: [DONE]\n\n")
        version = (await client.get("/version")).json()
    assert version["version"].count(".") == 2
