"""Speculative decoding on the real servers (config.pbtxt `speculative: ngram`; docs/speculation.md): the
same streams as the shared server's (speculation off), token for token and logprob for logprob, with
several tokens in one step's response where drafts were accepted, and the step checks of docs/contract.md."""

from __future__ import annotations

import asyncio
import time

import pytest
from openai import OpenAI

from scripts.servers import DEFAULT_MODEL, copy_model_repository
from tests.e2e.helpers import running_servers
from tests.e2e.triton_stream import check_invariants, metric_value, stream_generate

pytestmark = pytest.mark.e2e

# A passage the model is asked to repeat: what prompt lookup drafts well.
PASSAGE = (
    "The river rises in the hills, runs through the old town under seven stone bridges, and reaches the "
    "sea at the harbour, where the fishing boats come in every morning before dawn."
)
COPY_PROMPT = f"Repeat this sentence exactly, twice.\nSentence: {PASSAGE}\nRepeated: {PASSAGE}\n{PASSAGE[:40]}"


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
    repository = copy_model_repository(
        tmp_path_factory.mktemp("speculation"), speculative="ngram", num_speculative_tokens="4",
        speculative_row_cost="0",
    )  # fmt: skip
    with running_servers(repository, "speculation") as (triton, frontend):
        yield triton, f"{frontend.url}/v1"


def completion_stream(base_url: str, **request) -> tuple[dict[int, list], dict[int, str], object]:
    """Per choice: (token text, logprob, top logprobs) of each chunk's tokens, and the text; and the usage."""
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    chunks = client.completions.create(
        model=DEFAULT_MODEL, stream=True, stream_options={"include_usage": True}, **request
    )
    per_chunk: dict[int, list] = {}
    text: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            lp = choice.logprobs
            if lp is not None and lp.tokens:
                per_chunk.setdefault(choice.index, []).append(list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)))
    return per_chunk, text, usage


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=7)],
    ids=["greedy", "seeded"],
)
def test_speculated_streams_equal_plain_ones(servers, speculating, sampling):
    triton, base_url = speculating
    accepted_before = metric_value(triton.metrics_url, "llm_spec_accepted_tokens_total")
    request = dict(prompt=COPY_PROMPT, max_tokens=48, n=2, logprobs=2, **sampling)
    plain, plain_text, plain_usage = completion_stream(servers.base_url, **request)
    speculated, text, usage = completion_stream(base_url, **request)
    assert text == plain_text and usage == plain_usage
    for index in (0, 1):
        assert [t for c in speculated[index] for t in c] == [t for c in plain[index] for t in c]
    deadline = time.monotonic() + 10  # the engine publishes its counters once it is idle again
    while metric_value(triton.metrics_url, "llm_spec_accepted_tokens_total") <= accepted_before:
        assert time.monotonic() < deadline, "no accepted drafts counted"
        time.sleep(0.1)
    if sampling["temperature"] == 0.0:  # both copies follow the passage: drafts were accepted, several a chunk
        assert max(len(c) for c in speculated[0]) > 1
        assert len(speculated[0]) < sum(len(c) for c in speculated[0]) == sum(len(c) for c in plain[0])


def test_speculated_chat_with_a_stop_string_and_a_schema_equals_plain(servers, speculating):
    _, base_url = speculating
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    plain_client = OpenAI(base_url=servers.base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": COPY_PROMPT}]
    for extra in (
        dict(stop=["bridges"]),
        dict(response_format={"type": "json_object"}, max_tokens=40),
    ):
        request = dict(model=DEFAULT_MODEL, messages=messages, temperature=0.0, max_tokens=60, logprobs=True) | extra
        got, expected = client.chat.completions.create(**request), plain_client.chat.completions.create(**request)
        assert got.choices[0].message.content == expected.choices[0].message.content
        assert got.choices[0].finish_reason == expected.choices[0].finish_reason
        assert [t.logprob for t in got.choices[0].logprobs.content] == [
            t.logprob for t in expected.choices[0].logprobs.content
        ]
        # (cached_tokens depends on what each server's prefix cache holds)
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (
            expected.usage.prompt_tokens,
            expected.usage.completion_tokens,
        )


def test_triton_level_stream_keeps_the_step_contract_with_several_tokens_a_step(speculating):
    triton, _ = speculating
    params = {"max_tokens": 40, "n": 2, "logprobs": 1, "temperature": 0.0}
    result = asyncio.run(stream_generate(triton.grpc_url, DEFAULT_MODEL, COPY_PROMPT, params))
    check_invariants(result, n=2, max_tokens=40, logprobs=1)
    assert any(len(r.token_ids) > 1 and r.num_steps == 1 for r in result.responses)
