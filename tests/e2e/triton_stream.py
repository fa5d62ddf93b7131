"""A tiny tritonclient gRPC streaming reader for the Triton-level tests (no frontend involved)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferInput


@dataclass
class Response:
    seq_index: int
    step: int
    token_ids: list[int]
    text_delta: str
    finish_reason: str
    stop_reason: object
    num_prompt_tokens: int
    num_output_tokens: int
    final: bool
    logprobs: list[float] | None = None
    token_texts: list[str] | None = None
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    num_steps: int = 1  # a response that joined several steps of its sequence (docs/contract.md)
    outputs: tuple[str, ...] = ()  # the names of the outputs the response carried


@dataclass
class StreamResult:
    responses: list[Response] = field(default_factory=list)
    error: str | None = None

    def by_seq(self) -> dict[int, list[Response]]:
        out: dict[int, list[Response]] = {}
        for r in self.responses:
            out.setdefault(r.seq_index, []).append(r)
        return out


def make_inputs(prompt: str | list[int] | None, params: dict | None) -> list[InferInput]:
    inputs = []
    if isinstance(prompt, str):
        t = InferInput("text_input", [1], "BYTES")
        t.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
        inputs.append(t)
    elif prompt is not None:
        t = InferInput("input_ids", [len(prompt)], "INT32")
        t.set_data_from_numpy(np.array(prompt, dtype=np.int32))
        inputs.append(t)
    if params is not None:
        raw = params if isinstance(params, str) else json.dumps(params)
        t = InferInput("sampling_params", [1], "BYTES")
        t.set_data_from_numpy(np.array([raw.encode()], dtype=np.object_))
        inputs.append(t)
    return inputs


def _decode(result) -> Response:
    def arr(name):
        return result.as_numpy(name)

    def text(name):
        return arr(name).reshape(-1)[0].decode()

    r = Response(
        seq_index=int(arr("seq_index")[0]),
        step=int(arr("step")[0]),
        token_ids=[int(t) for t in arr("token_ids")],
        text_delta=text("text_delta"),
        # Only in a sequence's last response (docs/wire-contract.md): absent, it goes on.
        finish_reason=text("finish_reason") if arr("finish_reason") is not None else "",
        stop_reason=json.loads(text("stop_reason")) if arr("stop_reason") is not None else None,
        num_prompt_tokens=int(arr("num_prompt_tokens")[0]),
        num_output_tokens=int(arr("num_output_tokens")[0]),
        final=result.get_response().parameters["triton_final_response"].bool_param,
        num_steps=int(arr("num_steps")[0]) if arr("num_steps") is not None else 1,
        outputs=tuple(o.name for o in result.get_response().outputs),
    )
    if arr("logprobs") is not None:
        r.logprobs = [float(x) for x in arr("logprobs")]
        r.token_texts = [x.decode() for x in arr("token_texts").reshape(-1)]
        r.top_token_ids = arr("top_token_ids").tolist()
        r.top_logprobs = arr("top_logprobs").tolist()
    if arr("prompt_token_ids") is not None:
        r.prompt_token_ids = [int(t) for t in arr("prompt_token_ids")]
        r.prompt_logprobs = [float(x) for x in arr("prompt_logprobs")]
    return r


async def stream_generate(
    url: str,
    model: str,
    prompt,
    params,
    cancel_after: int | None = None,
    request_id: str = "",
    on_response=None,
) -> StreamResult:
    """Sends one request and reads every response until the final flag (or cancels the call after N).
    `on_response(responses so far)` is awaited after each response."""
    client = grpcclient.InferenceServerClient(url)
    try:

        async def requests():
            yield {"model_name": model, "inputs": make_inputs(prompt, params), "request_id": request_id}

        stream = client.stream_infer(requests())
        out = StreamResult()
        async for result, error in stream:
            if error is not None:
                out.error = str(error)
                break
            response = _decode(result)
            out.responses.append(response)
            if on_response is not None:
                await on_response(out.responses)
            if cancel_after is not None and len(out.responses) >= cancel_after:
                stream.cancel()
                break
            if response.final:
                break
        return out
    finally:
        await client.close()


async def send_cancel(url: str, model: str, request_id: str) -> list:
    """The cancel message of docs/wire-contract.md, built as the frontend builds it; returns the
    ModelStreamInferResponses it was answered with (tritonclient's aio stream cannot ask for the empty
    final response, so this goes through its gRPC stub)."""
    from openai_frontend.triton_client import build_cancel

    client = grpcclient.InferenceServerClient(url)
    try:

        async def requests():
            yield build_cancel(model, request_id)

        answers = []
        async for response in client._client_stub.ModelStreamInfer(requests()):
            answers.append(response)
            if response.error_message or response.infer_response.parameters["triton_final_response"].bool_param:
                break
        return answers
    finally:
        await client.close()


def metrics(url: str, name: str) -> dict[str, float]:
    """Values of one metric by its `instance` label (or "" without one)."""
    with urllib.request.urlopen(url, timeout=5) as f:
        text = f.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            instance = re.search(r'instance="([^"]+)"', line)
            out[instance.group(1) if instance else ""] = float(line.rsplit(" ", 1)[1])
    return out


def metrics_once(url: str, name: str, ok, timeout: float = 10.0) -> dict[str, float]:
    """The metric's values by instance once `ok(values)` holds (or the last ones read): the engine
    publishes its stats between steps and when it goes idle, a moment after the last response went out,
    one metric after another."""
    deadline = time.monotonic() + timeout
    while not ok(values := metrics(url, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return values


def metric_value(metrics_url: str, name: str) -> float:
    """The value of a metric of a one-instance model (its first series)."""
    values = metrics(metrics_url, name)
    if not values:
        raise KeyError(name)
    return next(iter(values.values()))


def wait_until_aborted_and_freed(metrics_url: str, aborted_before: float, timeout: float = 20.0) -> None:
    """Waits until the engine has counted one more abort and holds no KV block and no running sequence.

    The abort counter is what makes the reading fresh: the gauges alone could still be the idle
    values published before the request ran.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric_value(metrics_url, "llm_aborted_requests_total") > aborted_before
            and metric_value(metrics_url, "llm_kv_blocks_used") == 0
            and metric_value(metrics_url, "llm_num_running") == 0
        ):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"not aborted and freed after {timeout:.0f}s: aborted_total="
        f"{metric_value(metrics_url, 'llm_aborted_requests_total')} (before {aborted_before}), "
        f"kv_blocks_used={metric_value(metrics_url, 'llm_kv_blocks_used')}, "
        f"num_running={metric_value(metrics_url, 'llm_num_running')}"
    )


def check_invariants(result: StreamResult, n: int, max_tokens: int | None = None, logprobs: int | None = None) -> None:
    """The invariants of docs/contract.md, per sequence."""
    assert result.error is None, result.error
    seqs = result.by_seq()
    assert sorted(seqs) == list(range(n))
    assert sum(r.final for r in result.responses) == 1 and result.responses[-1].final
    for index, responses in seqs.items():
        starts = list(np.cumsum([0] + [r.num_steps for r in responses[:-1]]))
        assert [r.step for r in responses] == starts, f"seq {index}: steps not contiguous"
        finishes = [r for r in responses if r.finish_reason]
        assert len(finishes) == 1 and finishes[0] is responses[-1], f"seq {index}: not exactly one finish, last"
        tokens = [t for r in responses for t in r.token_ids]
        assert responses[-1].num_output_tokens == len(tokens)
        assert [r.num_output_tokens for r in responses] == list(np.cumsum([len(r.token_ids) for r in responses]))
        if max_tokens is not None and responses[-1].finish_reason == "length":
            assert len(tokens) == max_tokens
        if logprobs is not None:
            for r in responses:
                assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
                assert len(r.top_token_ids) == len(r.token_ids)
                assert all(len(row) == logprobs for row in r.top_token_ids)
