"""TritonEngineClient: request building, response decoding, and the gRPC stream against an
in-process grpc.aio server that speaks Triton's GRPCInferenceService (real protobufs, real
tritonclient channel; no tritonserver).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from openai_frontend.app import create_app
from openai_frontend.errors import (
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    ModelNotFound,
    from_engine_message,
)
from openai_frontend.settings import GRPC_EXPERIMENTS, Settings, set_grpc_environment
from openai_frontend.triton_client import EMPTY_FINAL, TritonEngineClient, build_request, decode_response
from protocol import (
    AdmissionGroup,
    FinishReason,
    PromptLogprobs,
    RequestTimings,
    SamplingParams,
    StepOutput,
    TokenLogprobs,
    wire,
)
from tests.fake_engine import CHATML_TEMPLATE, scripted_steps

pytestmark = pytest.mark.asyncio


# -- encoding as the model does (protocol.wire.encode_step, model.py's encoder), into a gRPC response ------


DATATYPES = {np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64"}


def encode_step(out: StepOutput, final: bool | None = None) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name="llm", id=out.request_id)
    for name, array in wire.encode_step(out).items():
        if array.dtype == np.object_:
            response.outputs.add(name=name, datatype="BYTES", shape=list(array.shape))
            response.raw_output_contents.append(serialize_byte_tensor(array.reshape(-1)).item() if array.size else b"")
        else:
            dtype = DATATYPES[array.dtype]
            response.outputs.add(name=name, datatype=dtype, shape=list(array.shape))
            response.raw_output_contents.append(array.tobytes())
    if final if final is not None else out.request_finished:
        response.parameters["triton_final_response"].bool_param = True
    return response


def _lp(texts: list[str], k: int) -> TokenLogprobs:
    return TokenLogprobs(
        tuple(-0.25 * (i + 1) for i in range(len(texts))),
        tuple(texts),
        tuple(tuple(range(10, 10 + k)) for _ in texts),
        tuple(tuple(-1.0 - j for j in range(k)) for _ in texts),
        tuple(tuple(f"alt{j}\u00e9" for j in range(k)) for _ in texts),
    )


@pytest.mark.parametrize(
    "out",
    [
        StepOutput("r", 1, 4, (5, 6), "h\u00e9\U0001f600", _lp(["h\u00e9", "\U0001f600"], 2), None, None, 7, 5),
        StepOutput("r", 0, 0, (9,), "", _lp([""], 0), FinishReason.STOP, 9, 3, 1, True),
        StepOutput("r", 0, 2, (), "", _lp([], 3), FinishReason.ABORT, None, 3, 2, True),
        StepOutput("r", 2, 3, (4,), " end", None, FinishReason.STOP, "end", 3, 4),
        StepOutput("r", 0, 1, (4, 5, 6), "abc", None, FinishReason.LENGTH, None, 3, 16),
        StepOutput(
            "r",
            1,
            0,
            (7,),
            "x",
            _lp(["x"], 1),
            None,
            None,
            3,
            1,
            prompt_logprobs=PromptLogprobs(
                (1, 2, 3),
                ("<s>", " h\u00e9", "!"),
                (-1.5, -0.25),
                (4, 1),
                ((8, 9), (2, 8)),
                ((-0.5, -1.0), (-0.25, -2.0)),
                (("a", "b"), (" h\u00e9", "a")),
            ),
        ),
        StepOutput(
            "r",
            0,
            0,
            (7,),
            "x",
            None,
            None,
            None,
            1,
            1,
            prompt_logprobs=PromptLogprobs((5,), ("only",), (), (), (), (), ()),
        ),
        StepOutput("r", 1, 4, (7, 8, 9), "xyz", None, FinishReason.LENGTH, None, 3, 12, num_steps=3),
        StepOutput("r", 0, 0, (7,), "x", None, None, None, 40, 1, num_cached_tokens=32),
        StepOutput(
            "r", 1, 2, (7, 8), "xy", None, FinishReason.STOP, None, 40, 4, True, num_steps=2, num_cached_tokens=8
        ),
        StepOutput(
            "r", 0, 3, (7,), "x", None, FinishReason.LENGTH, None, 9, 4, True, timings=RequestTimings(0.1, 0.0, 1 / 3)
        ),
    ],
)
async def test_decode_round_trip(out: StepOutput) -> None:
    assert decode_response(encode_step(out), "r") == out
    assert ("num_steps" in wire.encode_step(out)) == (out.num_steps > 1)  # absent means one step
    assert ("num_cached_tokens" in wire.encode_step(out)) == (out.num_cached_tokens > 0)  # absent means none
    assert ("engine_timings" in wire.encode_step(out)) == (out.timings is not None)  # absent: not measured
    # absent means the sequence goes on
    assert ("finish_reason" in wire.encode_step(out)) == ("stop_reason" in wire.encode_step(out)) == out.finished


async def test_decode_empty_final_and_malformed() -> None:
    assert decode_response(service_pb2.ModelInferResponse(), "r") is None
    good = encode_step(scripted_steps([["a"]])[0])
    missing = service_pb2.ModelInferResponse()
    missing.CopyFrom(good)
    del missing.outputs[1]  # "step"
    del missing.raw_output_contents[1]
    with pytest.raises(EngineFailure, match="step"):
        decode_response(missing, "r")
    bad = encode_step(StepOutput("r", 0, 0, (1,), "x", None, FinishReason.STOP, None, 1, 1, True))
    finish = [o.name for o in bad.outputs].index("finish_reason")
    bad.raw_output_contents[finish] = serialize_byte_tensor(np.array([b"exploded"], dtype=np.object_)).item()
    with pytest.raises(EngineFailure, match="malformed"):
        decode_response(bad, "r")
    half = service_pb2.ModelInferResponse()
    half.CopyFrom(encode_step(StepOutput("r", 0, 0, (1,), "x", None, FinishReason.STOP, None, 1, 1, True)))
    stop = [o.name for o in half.outputs].index("stop_reason")
    del half.outputs[stop]
    del half.raw_output_contents[stop]
    with pytest.raises(EngineFailure, match="stop_reason missing beside finish_reason"):
        decode_response(half, "r")
    negative = encode_step(StepOutput("r", 0, 0, (1,), "x", None, None, None, 9, 1, num_cached_tokens=8))
    cached = [o.name for o in negative.outputs].index("num_cached_tokens")
    negative.raw_output_contents[cached] = np.array([-8], dtype=np.int32).tobytes()
    with pytest.raises(EngineFailure, match="num_cached_tokens must be >= 0"):
        decode_response(negative, "r")
    timed = StepOutput("r", 0, 0, (1,), "x", None, FinishReason.STOP, None, 9, 1, True, timings=RequestTimings(1, 2, 3))
    for values in ([1.0, -2.0, 3.0], [1.0, float("nan"), 3.0]):
        bad_timings = encode_step(timed)
        at = [o.name for o in bad_timings.outputs].index("engine_timings")
        bad_timings.raw_output_contents[at] = np.array(values, dtype=np.float64).tobytes()
        with pytest.raises(EngineFailure, match="engine_timings must hold 3 durations >= 0"):
            decode_response(bad_timings, "r")
    no_raw = service_pb2.ModelInferResponse()
    no_raw.CopyFrom(good)
    del no_raw.raw_output_contents[:]
    with pytest.raises(EngineFailure, match="raw output contents"):
        decode_response(no_raw, "r")


async def test_decode_checks_raw_sizes_and_types() -> None:
    """Responses are decoded from their raw bytes: every size and datatype is checked against the shape."""
    good = encode_step(scripted_steps([["a"]])[0])
    names = [o.name for o in good.outputs]

    def broken(name: str, raw: bytes | None = None, datatype: str | None = None, shape: list[int] | None = None):
        response = service_pb2.ModelInferResponse()
        response.CopyFrom(good)
        i = names.index(name)
        if raw is not None:
            response.raw_output_contents[i] = raw
        if datatype is not None:
            response.outputs[i].datatype = datatype
        if shape is not None:
            del response.outputs[i].shape[:]
            response.outputs[i].shape.extend(shape)
        return response

    cases = [
        broken("step", raw=b"\x01\x00\x00"),  # 3 bytes for one INT32
        broken("step", raw=np.array([1, 2], dtype=np.int32).tobytes(), shape=[2]),  # two steps
        broken("token_ids", datatype="FP32"),
        broken("text_delta", raw=b"\x09\x00\x00\x00abc"),  # an element longer than the tensor
        broken("text_delta", shape=[2]),  # one string for two
        broken("text_delta", raw=b"\x02\x00\x00\x00\xff\xfe"),  # not UTF-8
    ]
    for response in cases:
        with pytest.raises(EngineFailure, match="malformed") as raised:
            decode_response(response, "r")
        assert raised.value.code == "bad_response"
    assert decode_response(broken("step", raw=np.array([0], dtype=np.int32).tobytes()), "r").step == 0


async def test_build_request() -> None:
    params = SamplingParams(n=2, max_tokens=5, stop=("x",), logprobs=1, logit_bias=((3, 1.0),))
    request = build_request("llm", "Hello \u00e9", params, "req-1")
    assert request.model_name == "llm" and request.id == "req-1"
    assert [(i.name, i.datatype, list(i.shape)) for i in request.inputs] == [
        ("text_input", "BYTES", [1]),
        ("sampling_params", "BYTES", [1]),
    ]
    assert deserialize_bytes_tensor(request.raw_input_contents[0])[0].decode() == "Hello \u00e9"
    sent = deserialize_bytes_tensor(request.raw_input_contents[1])[0].decode()
    assert SamplingParams.from_json(sent) == params
    assert request.parameters[EMPTY_FINAL].bool_param
    # The engine reads its request parameters as python_backend gives them: a JSON object.
    forwarded = json.dumps({name: p.bool_param for name, p in request.parameters.items() if name != EMPTY_FINAL})
    assert wire.sends_cancel_message(forwarded)
    assert not wire.sends_cancel_message("{}") and not wire.sends_cancel_message("")
    assert not wire.sends_cancel_message('{"sends_cancel_message": "yes"}') and not wire.sends_cancel_message("[1]")
    ids = build_request("llm", [1, 2, 3], SamplingParams(), "r")
    assert (ids.inputs[0].name, ids.inputs[0].datatype, list(ids.inputs[0].shape)) == ("input_ids", "INT32", [3])
    assert np.frombuffer(ids.raw_input_contents[0], dtype=np.int32).tolist() == [1, 2, 3]
    assert wire.ADMISSION_GROUP not in request.parameters and wire.admission_group(forwarded) is None


async def test_an_admission_group_travels_as_request_parameters() -> None:
    request = build_request("llm", "x", SamplingParams(), "req-7-1", AdmissionGroup("req-7", 3))
    p = request.parameters
    # python_backend hands the engine its parameters as one JSON object of their values.
    forwarded = json.dumps(
        {
            wire.ADMISSION_GROUP: p[wire.ADMISSION_GROUP].string_param,
            wire.ADMISSION_GROUP_SIZE: p[wire.ADMISSION_GROUP_SIZE].int64_param,
        }
    )
    assert wire.admission_group(forwarded) == AdmissionGroup("req-7", 3)
    for bad in (
        '{"admission_group": "", "admission_group_size": 2}',
        '{"admission_group": "k"}',
        '{"admission_group": "k", "admission_group_size": true}',
        '{"admission_group": 5, "admission_group_size": 2}',
        '{"admission_group": "k", "admission_group_size": 0}',
        "not json",
        "[]",
    ):
        assert wire.admission_group(bad) is None, bad


async def test_the_frontend_sets_its_grpc_experiments_unless_the_user_did() -> None:
    environ: dict[str, str] = {}
    set_grpc_environment(environ)
    assert environ == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS} and "-event_engine_client" in GRPC_EXPERIMENTS
    theirs = {"GRPC_EXPERIMENTS": "event_engine_client"}
    set_grpc_environment(theirs)
    assert theirs == {"GRPC_EXPERIMENTS": "event_engine_client"}


async def test_engine_error_messages() -> None:
    e = from_engine_message(json.dumps({"type": "invalid_request_error", "message": "too long", "param": "prompt"}))
    assert isinstance(e, InvalidRequest) and (e.message, e.param, e.status_code) == ("too long", "prompt", 400)
    assert e.code is None
    e = from_engine_message(
        json.dumps(
            {
                "type": "invalid_request_error",
                "message": "too long",
                "param": "max_tokens",
                "code": "context_length_exceeded",
            }
        )
    )
    assert isinstance(e, InvalidRequest) and (e.param, e.code) == ("max_tokens", "context_length_exceeded")
    e = from_engine_message(
        "Failed to process the request: " + json.dumps({"type": "engine_error", "message": "oom", "param": None})
    )
    assert isinstance(e, EngineFailure) and e.message == "oom" and e.status_code == 500
    e = from_engine_message("segfault {not json}")
    assert isinstance(e, EngineFailure) and e.message == "segfault {not json}"


# -- an in-process server speaking Triton's gRPC API ---------------------------------------------

Responder = Callable[[service_pb2.ModelInferRequest], list[service_pb2.ModelStreamInferResponse | float]]


def _config(name: str, model_type: str) -> model_config_pb2.ModelConfig:
    config = model_config_pb2.ModelConfig(name=name, backend="python")
    config.parameters["model_type"].string_value = model_type
    config.parameters["chat_template"].string_value = CHATML_TEMPLATE
    config.parameters["eos_token"].string_value = "<|im_end|>"
    config.parameters["max_model_len"].string_value = "8192"
    return config


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.responder: Responder = lambda request: []
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.metadata: list[dict[str, str]] = []  # each request's gRPC metadata
        self.cancelled = asyncio.Event()
        self.cancel_messages: list[str] = []  # the request ids cancel messages named
        self.models = {"llm": ("READY", "llm"), "resnet": ("READY", "image"), "llm-loading": ("LOADING", "llm")}
        # What health probes answer ("<instance name>-<life id>"; a list: instances in turn); None: an error,
        # as a dead stub's.
        self.instance: str | list[str] | None = "engine-1"
        self.probes = 0

    # The method names are the gRPC service's (GRPCInferenceService), hence CamelCase.
    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=True)

    async def RepositoryIndex(self, request, context):
        return service_pb2.RepositoryIndexResponse(
            models=[
                service_pb2.RepositoryIndexResponse.ModelIndex(name=name, version="1", state=state)
                for name, (state, _) in self.models.items()
            ]
        )

    async def ModelConfig(self, request, context):
        if request.name not in self.models:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Request for unknown model: '{request.name}' is not found")
        return service_pb2.ModelConfigResponse(config=_config(request.name, self.models[request.name][1]))

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        try:  # one request per call, as our client sends; returning ends the call
            request = await anext(request_iterator.__aiter__())
            if any(i.name == "health_probe" for i in request.inputs):
                self.probes += 1
                yield self._probe_answer(request.model_name)
                return
            if any(i.name == "cancel_request_id" for i in request.inputs):
                self.cancel_messages.append(deserialize_bytes_tensor(request.raw_input_contents[0])[0].decode())
                final = service_pb2.ModelInferResponse(model_name=request.model_name)
                final.parameters["triton_final_response"].bool_param = True
                yield service_pb2.ModelStreamInferResponse(infer_response=final)
                return
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))
            for item in self.responder(request):
                if isinstance(item, float):
                    await asyncio.sleep(item)
                else:
                    yield item
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def _probe_answer(self, model: str) -> service_pb2.ModelStreamInferResponse:
        if self.instance is None:
            return service_pb2.ModelStreamInferResponse(error_message=f"Stub process '{model}_0_0' is not healthy.")
        response = service_pb2.ModelInferResponse(model_name=model)
        response.outputs.add(name="health", datatype="BYTES", shape=[1])
        instance = self.instance[self.probes % len(self.instance)] if isinstance(self.instance, list) else self.instance
        health = json.dumps({"instance": instance, "engine": "running"}).encode()
        response.raw_output_contents.append(serialize_byte_tensor(np.array([health], dtype=np.object_)).item())
        response.parameters["triton_final_response"].bool_param = True
        return service_pb2.ModelStreamInferResponse(infer_response=response)


def ok(out: StepOutput, final: bool | None = None) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(infer_response=encode_step(out, final))


def fail(kind: str, message: str, param: str | None = None) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(
        error_message=json.dumps({"type": kind, "message": message, "param": param})
    )


@pytest.fixture
async def triton() -> AsyncIterator[tuple[FakeTriton, str]]:
    server = grpc.aio.server()
    servicer = FakeTriton()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(grace=None)


async def _collect(
    client: TritonEngineClient, prompt: Any = "hi", params: SamplingParams | None = None
) -> list[StepOutput]:
    return [out async for out in client.generate("llm", prompt, params or SamplingParams(n=2), "req-7")]


async def test_generate_streams_until_final(triton) -> None:
    server, url = triton
    steps = scripted_steps([["a", "b"], ["c"]])
    server.responder = lambda request: [ok(s) for s in steps]
    client = TritonEngineClient(url)
    try:
        outs = await _collect(client)
        assert outs == [s.__class__(**{**_fields(s), "request_id": "req-7"}) for s in steps]
        assert outs[-1].request_finished
        request = server.requests[0]
        assert request.id == "req-7" and request.parameters[EMPTY_FINAL].bool_param
        # The same, ending with an empty (flags-only) final response.
        server.responder = lambda request: [
            *(ok(s, final=False) for s in steps),
            service_pb2.ModelStreamInferResponse(infer_response=_empty_final()),
        ]
        outs = await _collect(client)
        assert [o.text_delta for o in outs] == ["a", "c", "b"] and not outs[-1].request_finished
    finally:
        await client.close()


async def test_headers_go_with_the_request_as_its_grpc_metadata(triton) -> None:
    server, url = triton
    server.responder = lambda request: [ok(s) for s in scripted_steps([["a"]])]
    client = TritonEngineClient(url)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        await _collect(client, params=SamplingParams())
        headers = {"traceparent": traceparent, "tracestate": "k=v"}
        outs = [o async for o in client.generate("llm", "x", SamplingParams(), "r", headers=headers)]
        assert outs[-1].request_finished
    finally:
        await client.close()
    assert "traceparent" not in server.metadata[0]
    assert server.metadata[1]["traceparent"] == traceparent and server.metadata[1]["tracestate"] == "k=v"


def _fields(s: StepOutput) -> dict[str, Any]:
    return {name: getattr(s, name) for name in s.__slots__}


def _empty_final() -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name="llm")
    response.parameters["triton_final_response"].bool_param = True
    return response


async def test_generate_error_responses(triton) -> None:
    server, url = triton
    client = TritonEngineClient(url)
    try:
        server.responder = lambda request: [fail("invalid_request_error", "prompt too long", "prompt")]
        with pytest.raises(InvalidRequest) as info:
            await _collect(client)
        assert info.value.param == "prompt"
        first = scripted_steps([["a", "b"]])[0]
        server.responder = lambda request: [ok(first), fail("engine_error", "engine stopped")]
        seen: list[StepOutput] = []
        with pytest.raises(EngineFailure, match="engine stopped"):
            async for out in client.generate("llm", "x", SamplingParams(), "r"):
                seen.append(out)
        assert len(seen) == 1
        server.responder = lambda request: [ok(first)]  # the server ends the call without the final flag
        with pytest.raises(EngineFailure, match="final response"):
            await _collect(client)
    finally:
        await client.close()


async def test_closing_the_stream_cancels_the_triton_request(triton) -> None:
    # Both ways of docs/wire-contract.md: a cancel message naming the request id, and the cancelled call.
    server, url = triton
    server.responder = _slow_steps(100)
    client = TritonEngineClient(url)
    try:
        stream = client.generate("llm", "x", SamplingParams(max_tokens=100), "r-7")
        assert (await anext(stream)).step == 0
        await stream.aclose()
        await asyncio.wait_for(server.cancelled.wait(), 5)
        deadline = time.monotonic() + 5
        while not server.cancel_messages and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert server.cancel_messages == ["r-7"]
        assert [r.id for r in server.requests] == ["r-7"]  # the cancel message is not a generate request
    finally:
        await client.close()


async def test_a_request_that_ended_sends_no_cancel_message(triton) -> None:
    server, url = triton
    server.responder = _slow_steps(2)
    client = TritonEngineClient(url)
    try:
        outputs = [out async for out in client.generate("llm", "x", SamplingParams(max_tokens=2), "r-8")]
        assert len(outputs) == 2 and outputs[-1].request_finished
        await asyncio.sleep(0.1)
        assert server.cancel_messages == [] and not server.cancelled.is_set()
    finally:
        await client.close()


async def test_models_ready_and_not_found(triton) -> None:
    server, url = triton
    client = TritonEngineClient(url)
    try:
        models = await client.list_models()
        assert [m.name for m in models] == ["llm"]  # READY and model_type == "llm" only
        info = await client.model_config("llm")
        assert (info.chat_template, info.eos_token, info.max_model_len) == (CHATML_TEMPLATE, "<|im_end|>", 8192)
        with pytest.raises(ModelNotFound):
            await client.model_config("nope")
        with pytest.raises(ModelNotFound):
            await client.model_config("resnet")
        assert await client.ready()
        server.models = {"resnet": ("READY", "image")}
        assert not await client.ready()
    finally:
        await client.close()


async def test_unreachable_triton() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = TritonEngineClient(f"127.0.0.1:{port}", control_timeout_s=2)
    try:
        assert not await client.ready()
        with pytest.raises(EngineUnavailable):
            await client.list_models()
        with pytest.raises(EngineUnavailable):
            await client.model_config("llm")
        with pytest.raises(EngineUnavailable):
            await _collect(client)
    finally:
        await client.close()


async def test_app_over_grpc(triton) -> None:
    """The whole frontend over the real gRPC client: chat stream with logprobs, and a 404."""
    server, url = triton

    def respond(request: service_pb2.ModelInferRequest) -> list[Any]:
        params = SamplingParams.from_json(deserialize_bytes_tensor(request.raw_input_contents[1])[0].decode())
        steps = scripted_steps([["Hel", "lo"] for _ in range(params.n)], "stop", logprobs=params.logprobs)
        return [ok(s) for s in steps]

    server.responder = respond
    app = create_app(TritonEngineClient(url), Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": "llm",
                "messages": [{"role": "user", "content": "Hi"}],
                "n": 2,
                "stream": True,
                "logprobs": True,
                "top_logprobs": 1,
                "stream_options": {"include_usage": True},
            },
        )
        events = [line[6:] for line in r.text.split("\n\n") if line]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
        assert chunks[-1]["usage"]["completion_tokens"] == 4
        texts: dict[int, str] = {}
        for c in chunks[2:-1]:
            texts[c["choices"][0]["index"]] = (
                texts.get(c["choices"][0]["index"], "") + c["choices"][0]["delta"]["content"]
            )
        assert texts == {0: "Hello", 1: "Hello"}
        prompt = deserialize_bytes_tensor(server.requests[0].raw_input_contents[0])[0].decode()
        assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert (await http.post("/v1/completions", json={"model": "resnet", "prompt": "x"})).status_code == 404
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["llm"]
    await asyncio.sleep(0.05)
    assert not server.cancelled.is_set()  # a finished request is never cancelled
    await app.state.engine.close()


# -- the engine watchdog: a stub that died, an engine that was restarted ------------------------------


def _slow_steps(count: int = 200) -> Responder:
    steps = scripted_steps([[f"t{i}" for i in range(count)]])
    return lambda request: [x for s in steps for x in (ok(s), 0.02)]


async def test_a_dead_engine_ends_open_streams_and_refuses_new_ones(triton) -> None:
    server, url = triton
    server.responder = _slow_steps()
    client = TritonEngineClient(url, probe_interval_s=0.05, probe_timeout_s=1.0)
    try:
        stream = client.generate("llm", "x", SamplingParams(max_tokens=200), "r")
        assert (await anext(stream)).step == 0
        server.instance = None  # the stub died: probes now get Triton's "not healthy" error
        with pytest.raises(EngineUnavailable, match="not healthy") as info:
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        assert info.value.retry_after_s and info.value.status_code == 503
        await asyncio.wait_for(server.cancelled.wait(), 5)  # the hung Triton call is cancelled too
        with pytest.raises(EngineUnavailable):  # at once, without asking Triton
            await anext(client.generate("llm", "x", SamplingParams(), "r2"))
        assert len(server.requests) == 1
        assert not await client.ready()
        server.instance = "engine-2"  # reloaded
        await asyncio.sleep(0.1)
        assert await client.ready()
        server.responder = lambda request: [ok(s) for s in scripted_steps([["a"]])]
        assert [o.text_delta for o in await _collect(client, params=SamplingParams())] == ["a"]
    finally:
        await client.close()


async def test_an_engine_restarted_between_probes_ends_the_streams_it_had(triton) -> None:
    server, url = triton
    server.responder = _slow_steps()
    client = TritonEngineClient(url, probe_interval_s=0.05, probe_timeout_s=1.0)
    try:
        assert await client.ready()  # engine-1 known
        stream = client.generate("llm", "x", SamplingParams(max_tokens=200), "r")
        assert (await anext(stream)).step == 0
        server.instance = "engine-2"
        with pytest.raises(EngineUnavailable, match="restarted"):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
        server.responder = lambda request: [ok(s) for s in scripted_steps([["a"]])]
        assert len(await _collect(client, params=SamplingParams())) == 1  # the new engine serves
    finally:
        await client.close()


async def test_not_healthy_from_a_request_marks_the_model_down_and_the_app_says_503(triton) -> None:
    server, url = triton
    server.instance = None
    server.responder = lambda request: [
        service_pb2.ModelStreamInferResponse(error_message="Stub process 'llm_0_0' is not healthy.")
    ]
    app = create_app(TritonEngineClient(url, probe_interval_s=0.05), Settings())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        r = await http.post("/v1/completions", json={"model": "llm", "prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "service_unavailable_error"
        assert (await http.get("/health/ready")).status_code == 503
        r = await http.post("/v1/completions", json={"model": "llm", "prompt": "x", "stream": True})
        assert r.status_code == 503 and len(server.requests) == 1  # refused before reaching Triton
        server.instance = "engine-2"
        await asyncio.sleep(0.1)
        assert (await http.get("/health/ready")).status_code == 200
    await app.state.engine.close()


async def test_several_instances_answering_in_turn_are_not_a_restart(triton) -> None:
    server, url = triton
    server.instance = ["llm_0_0-aaa", "llm_0_1-bbb"]
    server.responder = _slow_steps(30)
    client = TritonEngineClient(url, probe_interval_s=0.02, probe_timeout_s=1.0)
    try:
        outs = [o async for o in client.generate("llm", "x", SamplingParams(max_tokens=30), "r")]
        assert len(outs) == 30 and server.probes >= 4
        server.responder = _slow_steps(200)
        stream = client.generate("llm", "x", SamplingParams(max_tokens=200), "r2")
        assert (await anext(stream)).step == 0
        server.instance = ["llm_0_0-ccc", "llm_0_1-bbb"]  # instance 0 was restarted
        with pytest.raises(EngineUnavailable, match="restarted"):
            async with asyncio.timeout(5):
                async for _ in stream:
                    pass
    finally:
        await client.close()
