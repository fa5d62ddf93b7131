"""The decoupled Triton model behind the real tritonserver, over tritonclient gRPC streaming."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.triton_stream import (
    check_invariants,
    metric_value,
    send_cancel,
    stream_generate,
    wait_until_aborted_and_freed,
)
from tests.engine_helpers import smollm2_tokenizer

PROMPT = "The capital of France is"


def run(coro):
    return asyncio.run(coro)


def test_n3_logprobs2_streams_exact_per_sequence(servers):
    params = {"n": 3, "max_tokens": 8, "temperature": 0.8, "seed": 7, "logprobs": 2}
    result = run(stream_generate(servers.triton.grpc_url, servers.model, PROMPT, params))
    check_invariants(result, n=3, max_tokens=8, logprobs=2)
    for responses in result.by_seq().values():
        for r in responses:
            # Top alternatives are sorted and the sampled token's logprob is a real log-probability.
            for row in r.top_logprobs:
                assert row == sorted(row, reverse=True)
            assert all(lp <= 0.0 for lp in r.logprobs)
            # The logprob token texts join to the text of the step (no stop strings here).
            assert "".join(r.token_texts) == r.text_delta or r.finish_reason


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_n2_finishing_in_the_same_step_keeps_every_token(servers, max_tokens):
    params = {"n": 2, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    result = run(stream_generate(servers.triton.grpc_url, servers.model, PROMPT, params))
    check_invariants(result, n=2, max_tokens=max_tokens, logprobs=0)
    for responses in result.by_seq().values():
        assert sum(len(r.token_ids) for r in responses) == max_tokens
        assert responses[-1].finish_reason == "length"
        # finish_reason and stop_reason travel in the sequence's last response only (docs/wire-contract.md)
        assert [("finish_reason" in r.outputs, "stop_reason" in r.outputs) for r in responses] == [(False, False)] * (
            len(responses) - 1
        ) + [(True, True)]


def test_text_and_token_ids_prompts_agree(servers):
    params = {"max_tokens": 6, "temperature": 0}
    by_text = run(stream_generate(servers.triton.grpc_url, servers.model, PROMPT, params))
    check_invariants(by_text, n=1)
    # The same prompt as token ids gives the same tokens (greedy).
    prompt_ids = smollm2_tokenizer().encode(PROMPT)
    by_ids = run(stream_generate(servers.triton.grpc_url, servers.model, prompt_ids, params))
    check_invariants(by_ids, n=1)
    assert [t for r in by_ids.responses for t in r.token_ids] == [t for r in by_text.responses for t in r.token_ids]


def test_sixteen_concurrent_requests_of_mixed_n(servers):
    async def all_requests():
        jobs = []
        for i in range(16):
            n = 1 + i % 3
            params = {
                "n": n,
                "max_tokens": 4 + (i * 5) % 13,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
                "logprobs": 1 if i % 2 else None,
            }
            jobs.append(
                (n, params, stream_generate(servers.triton.grpc_url, servers.model, f"Story {i}: once", params))
            )
        results = await asyncio.gather(*(job for _, _, job in jobs))
        return [(n, params, result) for (n, params, _), result in zip(jobs, results)]

    for n, params, result in run(all_requests()):
        check_invariants(result, n=n, max_tokens=params["max_tokens"], logprobs=params["logprobs"])
        for responses in result.by_seq().values():
            assert sum(len(r.token_ids) for r in responses) == params["max_tokens"]


def test_cancel_mid_stream_frees_kv_blocks(servers):
    aborted_before = metric_value(servers.triton.metrics_url, "llm_aborted_requests_total")
    params = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    result = run(
        stream_generate(servers.triton.grpc_url, servers.model, "Count to a thousand:", params, cancel_after=3)
    )
    assert len(result.responses) == 3 and not result.responses[-1].finish_reason
    wait_until_aborted_and_freed(servers.triton.metrics_url, aborted_before)


def test_a_cancel_message_ends_the_request_it_names_and_frees_its_blocks(servers):
    # The gRPC call stays open: only the cancel message can end the request (every sequence with "abort").
    aborted_before = metric_value(servers.triton.metrics_url, "llm_aborted_requests_total")
    params = {"n": 2, "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    answers = []

    async def cancel_at_three(responses):
        if len(responses) == 3:
            answers.extend(await send_cancel(servers.triton.grpc_url, servers.model, "victim-1"))

    async def scenario():
        other = asyncio.create_task(
            stream_generate(servers.triton.grpc_url, servers.model, PROMPT, {"max_tokens": 40, "ignore_eos": True})
        )
        url, model = servers.triton.grpc_url, servers.model
        victim = await stream_generate(url, model, PROMPT, params, request_id="victim-1", on_response=cancel_at_three)
        return victim, await other

    victim, other = run(scenario())
    assert len(answers) == 1 and not answers[0].error_message  # one empty final response
    assert len(answers[0].infer_response.outputs) == 0
    check_invariants(victim, n=2)
    assert {seq: rs[-1].finish_reason for seq, rs in victim.by_seq().items()} == {0: "abort", 1: "abort"}
    assert sum(len(r.token_ids) for r in victim.responses) < 2 * 2000
    check_invariants(other, n=1, max_tokens=40)  # a request with another id goes on to its end
    assert other.responses[-1].finish_reason == "length"
    wait_until_aborted_and_freed(servers.triton.metrics_url, aborted_before)


@pytest.mark.parametrize(
    "prompt, params, needle",
    [
        (PROMPT, "{not json", "not valid JSON"),
        (PROMPT, {"max_tokenz": 3}, "unknown sampling parameter"),
        (PROMPT, {"n": 0}, "n must be"),
        (PROMPT, {"max_tokens": 0}, "max_tokens"),
        (PROMPT, {"logprobs": 21}, "logprobs"),
        ("word " * 9000, {"max_tokens": 1}, '"code": "context_length_exceeded"'),
        (PROMPT, {"max_tokens": 8192}, '"param": "max_tokens", "code": "context_length_exceeded"'),
        ("", {"max_tokens": 1}, "empty"),
        (None, {"max_tokens": 1}, "text_input"),
    ],
)
def test_bad_input_gets_an_error_and_the_model_keeps_serving(servers, prompt, params, needle):
    bad = run(stream_generate(servers.triton.grpc_url, servers.model, prompt, params))
    assert bad.error is not None and needle in bad.error, bad.error
    good = run(stream_generate(servers.triton.grpc_url, servers.model, PROMPT, {"max_tokens": 2}))
    check_invariants(good, n=1)


def test_model_control_refuses_a_caller_without_the_control_key(servers):
    """Loading a model runs its code: Triton's model-repository API answers only the launcher's key."""
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from protocol.wire import CONTROL_KEY_GRPC_METADATA
    from scripts.servers import control_key

    http = f"http://127.0.0.1:{servers.triton.http_port}"
    for path in (f"/v2/repository/models/{servers.model}/unload", "/v2/repository/index"):
        request = urllib.request.Request(http + path, data=b"{}", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code in (401, 403)
    client = grpcclient.InferenceServerClient(servers.triton.grpc_url)
    with pytest.raises(InferenceServerException):
        client.unload_model(servers.model)
    with pytest.raises(InferenceServerException):
        client.get_model_repository_index()
    index = client.get_model_repository_index(headers={CONTROL_KEY_GRPC_METADATA: control_key()}, as_json=True)
    assert [m["state"] for m in index["models"] if m["name"] == servers.model] == ["READY"]
    assert client.is_model_ready(servers.model)
