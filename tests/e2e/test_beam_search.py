"""Beam search end to end: openai client -> frontend -> gRPC -> real tritonserver -> engine's beams
(forked sequences sharing KV blocks), on completions and chat; streamed it is a 400."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=300)


def test_completions_return_n_different_beams_best_first_and_one_beam_is_greedy(client, servers):
    beam = dict(use_beam_search=True)
    r = client.completions.create(
        model=servers.model, prompt="The capital of France is", n=3, max_tokens=10, logprobs=1, extra_body=beam
    )
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3, texts
    for c in r.choices:
        assert "".join(c.logprobs.tokens) == c.text or c.finish_reason == "stop"
    # ranked best first: with length_penalty 1, cum logprob / (prompt + output tokens)
    prompt_tokens = r.usage.prompt_tokens
    scores = [
        sum(c.logprobs.token_logprobs) / (prompt_tokens + len(c.logprobs.tokens) - (c.finish_reason == "stop"))
        for c in sorted(r.choices, key=lambda c: c.index)
    ]
    assert scores == sorted(scores, reverse=True)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)

    one = client.completions.create(model=servers.model, prompt="Say hi.", n=1, max_tokens=12, extra_body=beam)
    greedy = client.completions.create(model=servers.model, prompt="Say hi.", max_tokens=12, temperature=0)
    assert one.choices[0].text == greedy.choices[0].text


def test_chat_beams_and_a_streamed_search_is_a_400(client, servers):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(
        model=servers.model, messages=messages, n=2, max_tokens=16, extra_body=dict(use_beam_search=True)
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=servers.model,
            messages=messages,
            n=2,
            max_tokens=4,
            stream=True,
            extra_body=dict(use_beam_search=True),
        )
    assert e.value.body["param"] == "use_beam_search"
