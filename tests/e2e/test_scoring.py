"""Scoring and vLLM's request surface end to end (openai client and raw HTTP -> frontend -> real
tritonserver -> engine): prompt logprobs against the in-process engine, echo, max_tokens 0, token ids,
the tokenizer endpoints, chat template controls, /invocations, and the Triton-level step contract.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from protocol import SamplingParams
from tests.e2e.triton_stream import check_invariants, stream_generate
from tests.engine_helpers import smollm2_checkpoint

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=256, num_threads=1), checkpoint=smollm2_checkpoint())


def in_process_prompt_logprobs(engine: LLMEngine, ids: list[int], k: int):
    engine.add_request(engine.make_request("ref", ids, SamplingParams(max_tokens=1, prompt_logprobs=k)))
    firsts = []
    while engine.has_work():
        firsts += [o for o in engine.step() if o.step == 0]
    return firsts[0].prompt_logprobs


def test_echo_logprobs_equal_the_in_process_engine(client, servers, engine):
    ids = engine.tokenizer.encode(PROMPT)
    reference = in_process_prompt_logprobs(engine, ids, 2)
    # A text prompt and the same prompt as token ids, twice: the second is not served from the prefix cache.
    for prompt in (PROMPT, ids, ids):
        full = client.completions.create(
            model=servers.model, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0
        )
        lp = full.choices[0].logprobs
        assert full.choices[0].text.startswith(PROMPT)
        assert lp.tokens[: len(ids)] == list(reference.token_texts)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx(reference.logprobs, abs=1e-4)
        for served, alts, values in zip(
            lp.top_logprobs[1 : len(ids)], reference.top_token_texts, reference.top_logprobs
        ):
            for alt, value in zip(alts, values):
                assert served[alt] == pytest.approx(value, abs=1e-4)
        assert len(lp.tokens) == len(ids) + 1 and lp.text_offset[0] == 0


def test_max_tokens_zero_scores_without_generating(client, servers, engine):
    ids = engine.tokenizer.encode(PROMPT)
    reference = in_process_prompt_logprobs(engine, ids, 0)
    full = client.completions.create(model=servers.model, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = full.choices[0]
    assert choice.text == PROMPT and full.usage.completion_tokens == 0 and full.usage.prompt_tokens == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(reference.logprobs, abs=1e-4)


def test_prompt_logprobs_and_token_ids(servers, engine):
    ids = engine.tokenizer.encode(PROMPT)
    reference = in_process_prompt_logprobs(engine, ids, 1)
    body = {
        "model": servers.model,
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "n": 2,
        "prompt_logprobs": 1,
        "return_token_ids": True,
    }
    r = httpx.post(f"{servers.base_url}/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 3
        pl = choice["prompt_logprobs"]
        assert pl[0] is None and len(pl) == len(ids)
        for entry, token_id, value in zip(pl[1:], ids[1:], reference.logprobs):
            assert entry[str(token_id)]["logprob"] == pytest.approx(value, abs=1e-4)
    chat = httpx.post(
        f"{servers.base_url}/chat/completions",
        timeout=120,
        json={
            "model": servers.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
            "return_token_ids": True,
        },
    ).json()
    assert len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]


def test_tokenizer_endpoints_agree_with_the_engine(servers, engine):
    root = servers.frontend.url
    text = "Hello, world! <|im_end|>"
    tokens = httpx.post(f"{root}/tokenize", json={"model": servers.model, "prompt": text}).json()["tokens"]
    assert tokens == engine.tokenizer.encode(text)
    assert httpx.post(f"{root}/detokenize", json={"tokens": tokens}).json()["prompt"] == text
    info = httpx.get(f"{root}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "{% for message in messages %}" in info["chat_template"]
    chat = httpx.post(f"{root}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    r = httpx.post(
        f"{servers.base_url}/chat/completions",
        json={"model": servers.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    ).json()
    assert chat["count"] == r["usage"]["prompt_tokens"]


def test_chat_continue_final_message_and_invocations(servers):
    root = servers.frontend.url
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    body = {
        "model": servers.model,
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    r = httpx.post(f"{root}/invocations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is") and "Paris" in content
    r = httpx.post(f"{root}/invocations", json={"model": servers.model, "prompt": PROMPT, "max_tokens": 2}, timeout=120)
    assert r.json()["object"] == "text_completion"
    assert httpx.get(f"{root}/version").json()["version"]


async def test_triton_level_prompt_logprobs_keep_the_step_contract(servers, engine):
    """A tritonclient user asking for prompt logprobs with n=3: they come on each sequence's step 0,
    and the steps stay contiguous."""
    ids = engine.tokenizer.encode(PROMPT)
    params = {"n": 3, "max_tokens": 4, "prompt_logprobs": 2, "seed": 3}
    result = await stream_generate(servers.triton.grpc_url, servers.model, PROMPT, params)
    assert result.error is None and result.responses[-1].final
    check_invariants(result, n=3)
    for steps in result.by_seq().values():
        assert steps[0].prompt_token_ids == ids and len(steps[0].prompt_logprobs) == len(ids) - 1
        assert all(r.prompt_token_ids is None for r in steps[1:])


def test_token_names_template_kwargs_custom_roles_and_streamed_chat_echo(servers, engine):
    root, model = servers.frontend.url, servers.model
    r = httpx.post(
        f"{servers.base_url}/completions",
        timeout=120,
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 3,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "temperature": 0,
        },
    ).json()
    choice = r["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    # chat_template_kwargs may not replace a variable the request's own fields set (a 400 naming it).
    messages = [{"role": "user", "content": "Hi"}]
    refused = httpx.post(
        f"{root}/tokenize",
        json={"model": model, "messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
    custom = httpx.post(
        f"{root}/tokenize",
        json={"model": model, "return_token_strs": True, "messages": [{"role": "narrator", "content": "Once"}]},
    ).json()
    assert "narrator" in "".join(custom["token_strs"])
    body = {
        "model": model,
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "echo": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue and"}],
    }
    with httpx.stream("POST", f"{servers.base_url}/chat/completions", json=body, timeout=120) as response:
        chunks = [
            json.loads(line[6:])
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content.startswith("Blue and") and len(content) > len("Blue and")
