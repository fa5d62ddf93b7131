"""The OpenAI API end to end: openai client and raw HTTP -> frontend -> gRPC -> real tritonserver -> engine."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest

from tests.e2e.triton_stream import metric_value, wait_until_aborted_and_freed

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=120)


def stream_completion(client, model, **kwargs):
    """Returns (text per choice, tokens per choice, finish per choice, usage, chunks)."""
    chunks = list(client.completions.create(model=model, stream=True, **kwargs))
    texts, tokens, finish = {}, {}, {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None and not chunk.choices:
            assert usage is None, "one usage chunk"
            usage = chunk.usage
        for choice in chunk.choices:
            assert choice.index not in finish, "nothing after a choice's finish"
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.logprobs is not None:
                tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
                assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
                assert "".join(choice.logprobs.tokens) == choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return texts, tokens, finish, usage, chunks


def test_models_lists_the_model(client, servers):
    assert [m.id for m in client.models.list().data] == [servers.model]


def test_streamed_text_equals_non_streamed_text_greedy(client, servers):
    full = client.completions.create(model=servers.model, prompt=PROMPT, max_tokens=16, temperature=0)
    texts, _, finish, _, _ = stream_completion(client, servers.model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert full.choices[0].text == texts[0] and full.choices[0].text.strip()
    assert full.choices[0].finish_reason == finish[0]
    assert full.usage.completion_tokens <= 16 and full.usage.prompt_tokens == 5
    assert "Paris" in full.choices[0].text


def test_streamed_equals_non_streamed_seeded_sampling_with_logprobs(client, servers):
    kwargs = dict(prompt="Once upon a time", max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, n=2, logprobs=2)
    full = client.completions.create(model=servers.model, **kwargs)
    texts, tokens, _, _, _ = stream_completion(client, servers.model, **kwargs)
    for choice in full.choices:
        assert choice.text == texts[choice.index]
        assert choice.logprobs.tokens == tokens[choice.index]


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_n2_logprobs0_stream_include_usage_keeps_every_token(client, servers, max_tokens):
    texts, tokens, finish, usage, _ = stream_completion(
        client,
        servers.model,
        prompt=PROMPT,
        n=2,
        logprobs=0,
        max_tokens=max_tokens,
        temperature=0.8,
        seed=5,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert sorted(finish) == [0, 1] and set(finish.values()) == {"length"}
    assert all(len(tokens[i]) == max_tokens for i in (0, 1))
    assert usage.completion_tokens == 2 * max_tokens and usage.prompt_tokens == 5


def test_chat_n2_with_top_logprobs(client, servers):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=servers.model, messages=messages, max_tokens=12, n=2, temperature=0, logprobs=True, top_logprobs=3
    )
    assert len(full.choices) == 2
    for choice in full.choices:
        assert choice.message.role == "assistant" and "Paris" in choice.message.content
        assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
        assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content
    # OpenAI's fields that change nothing here are accepted from OpenAI's own client: same text.
    no_effect = dict(
        store=False, metadata={"run": "e2e"}, service_tier="auto", prompt_cache_key="k", safety_identifier="u"
    )
    chunks = list(
        client.chat.completions.create(
            model=servers.model, messages=messages, max_tokens=12, n=2, temperature=0, stream=True, **no_effect
        )
    )
    firsts = {}
    text = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            firsts.setdefault(c.index, c.delta.role)
            text[c.index] += c.delta.content or ""
    assert firsts == {0: "assistant", 1: "assistant"}
    assert text == {c.index: c.message.content for c in full.choices}


def test_stop_string_ends_the_text_before_it(client, servers):
    base = client.completions.create(model=servers.model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = base.strip().split()[1]  # a word from the middle of the greedy text
    cut = client.completions.create(model=servers.model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text and base.startswith(choice.text)
    assert choice.model_extra.get("stop_reason") == stop


def test_allowed_token_ids_limit_every_streamed_token(servers):
    tokenized = httpx.post(f"{servers.frontend.url}/tokenize", json={"prompt": " yes no maybe"}, timeout=60)
    allowed = tokenized.json()["tokens"]
    body = {
        "model": servers.model,
        "prompt": PROMPT,
        "max_tokens": 6,
        "n": 2,
        "temperature": 1.0,
        "stream": True,
        "ignore_eos": True,
        "allowed_token_ids": allowed,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{servers.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            ids.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert sorted(ids) == [0, 1] and all(len(v) == 6 and set(v) <= set(allowed) for v in ids.values()), ids
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    oov = httpx.post(
        f"{servers.base_url}/completions",
        json={"model": servers.model, "prompt": PROMPT, "allowed_token_ids": [10**6]},
        timeout=60,
    )
    assert oov.status_code == 400 and oov.json()["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_runs_the_last_tokens(client, servers):
    text = "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of"
    ids = httpx.post(f"{servers.frontend.url}/tokenize", json={"prompt": text}, timeout=60).json()["tokens"]
    cut = client.completions.create(
        model=servers.model, prompt=text, max_tokens=5, temperature=0, extra_body={"truncate_prompt_tokens": 6}
    )
    same = client.completions.create(model=servers.model, prompt=ids[-6:], max_tokens=5, temperature=0)
    assert cut.usage.prompt_tokens == 6 and cut.choices[0].text == same.choices[0].text
    whole = client.completions.create(model=servers.model, prompt=text, max_tokens=5, temperature=0)
    assert whole.usage.prompt_tokens == len(ids) > 6


def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(client, servers):
    # A fresh first block (its own id), then text enough for several KV blocks (config.pbtxt's block_size 16).
    prompt = f"Request {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 12
    first, again = (client.completions.create(model=servers.model, prompt=prompt, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 4 * 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Whole blocks only, and never the last token (it is computed for its logits).
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens - 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0
    messages = [{"role": "user", "content": prompt}]
    chats = [
        list(
            client.chat.completions.create(
                model=servers.model,
                messages=messages,
                max_tokens=2,
                stream=True,
                stream_options={"include_usage": True},
            )
        )[-1].usage
        for _ in range(2)
    ]
    assert chats[0].prompt_tokens_details.cached_tokens < chats[1].prompt_tokens_details.cached_tokens
    assert chats[1].prompt_tokens_details.cached_tokens >= chats[1].prompt_tokens - 16


def test_bad_words_are_not_generated(client, servers):
    def greedy(**extra):
        body = {"model": servers.model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{servers.base_url}/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    word = greedy()["text"].split()[0]  # the greedy answer's first word
    banned = greedy(bad_words=[word])
    for form in (word, " " + word):
        ids = httpx.post(f"{servers.frontend.url}/tokenize", json={"prompt": form}, timeout=60).json()["tokens"]
        out = banned["token_ids"]
        assert all(out[i : i + len(ids)] != ids for i in range(len(out))), (form, ids, out)


def test_a_stop_token_adds_no_text_unless_include_stop_str_in_output(servers):
    body = {"model": servers.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    first = httpx.post(f"{servers.base_url}/completions", json=body, timeout=60).json()["choices"][0]
    token = first["token_ids"][0]
    for include in (False, True):
        r = httpx.post(
            f"{servers.base_url}/completions",
            json={**body, "stop_token_ids": [token], "include_stop_str_in_output": include, "logprobs": 0},
            timeout=60,
        )
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"], choice["token_ids"]) == ("stop", token, [token])
        assert choice["text"] == (choice["logprobs"]["tokens"][0] if include else "")
        assert first["text"].startswith(choice["logprobs"]["tokens"][0])


def test_echo_prepends_the_prompt(client, servers):
    out = client.completions.create(model=servers.model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)


def test_raw_sse_ends_with_done(servers):
    body = {"model": servers.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{servers.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ({"prompt": PROMPT, "max_tokenz": 3}, 400, "max_tokenz", None),
        ({"prompt": PROMPT, "n": 0}, 400, "n", None),
        ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs", None),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature", None),
        ({"prompt": PROMPT, "best_of": 3, "n": 1}, 400, "best_of", None),
        ({"prompt": "word " * 9000, "max_tokens": 1}, 400, "prompt", "context_length_exceeded"),
        ({"prompt": PROMPT, "max_tokens": 8192}, 400, "max_tokens", "context_length_exceeded"),
        ({"prompt": "caf\ud800"}, 400, "prompt", None),
        ({"prompt": PROMPT, "model": "no-such-model"}, 404, "model", "model_not_found"),
        ({"prompt": "", "max_tokens": 1}, 400, "prompt", None),
    ],
)
def test_bad_input_gets_openai_error_json(servers, body, status, param, code):
    payload = json.dumps({"model": servers.model, **body})  # ASCII: a lone surrogate travels as \ud800
    r = httpx.post(
        f"{servers.base_url}/completions", content=payload, timeout=60, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    ok = httpx.post(
        f"{servers.base_url}/completions", json={"model": servers.model, "prompt": PROMPT, "max_tokens": 2}, timeout=60
    )
    assert ok.status_code == 200


def test_client_disconnect_cancels_the_request(servers):
    aborted_before = metric_value(servers.triton.metrics_url, "llm_aborted_requests_total")
    body = {"model": servers.model, "prompt": "Count:", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{servers.base_url}/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    wait_until_aborted_and_freed(servers.triton.metrics_url, aborted_before)


@pytest.mark.slow
def test_32_concurrent_streams_mixed_with_long_prompts_are_exact(servers):
    async def one(http: httpx.AsyncClient, i: int):
        n = 1 + i % 2
        max_tokens = 8 + i % 9
        prompt = ("A long story about the sea. " * 40) if i % 4 == 0 else f"Request {i}: tell me about"
        body = {
            "model": servers.model,
            "prompt": prompt,
            "n": n,
            "max_tokens": max_tokens,
            "stream": True,
            "logprobs": 0 if i % 3 else None,
            "temperature": 0.7,
            "seed": i,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        counts, finishes, usage, done = {}, {}, None, False
        async with http.stream("POST", f"{servers.base_url}/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                assert "error" not in chunk, chunk
                if not chunk["choices"]:
                    usage = chunk["usage"]
                for c in chunk["choices"]:
                    assert c["index"] not in finishes
                    if c["logprobs"] is not None:
                        counts[c["index"]] = counts.get(c["index"], 0) + len(c["logprobs"]["tokens"])
                    if c["finish_reason"]:
                        finishes[c["index"]] = c["finish_reason"]
        assert done and sorted(finishes) == list(range(n))
        assert usage["completion_tokens"] == n * max_tokens
        if body["logprobs"] is not None:
            assert counts == {k: max_tokens for k in range(n)}

    async def main():
        async with httpx.AsyncClient(timeout=300) as http:
            await asyncio.gather(*(one(http, i) for i in range(32)))

    asyncio.run(main())
