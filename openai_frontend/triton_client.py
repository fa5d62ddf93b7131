"""TritonEngineClient: the EngineClient over Triton's gRPC API (tritonclient.grpc.aio).

One shared `tritonclient.grpc.aio.InferenceServerClient` (one gRPC channel) per frontend process,
created lazily inside the running event loop. Each engine request is one bidirectional
`ModelStreamInfer` call carrying one request and reading one response per StepOutput
(docs/wire-contract.md) until the response flagged `triton_final_response`.

Why the stub and not `InferenceServerClient.stream_infer`: the aio `stream_infer` cannot ask for
the empty final response (`triton_enable_empty_final_response` is a reserved parameter it refuses,
and it has no keyword for it, unlike the sync client). Without it a model that ends a request with a
flags-only response would leave us waiting forever. So the request is built here from public
protobuf types and sent through the client's own stub (`_client_stub`, the one attribute of
tritonclient used that is not public). Step responses are decoded from the raw bytes of their outputs
(protocol/wire.py), the health probe's with tritonclient's InferResult.
A request whose client went away is ended twice over (docs/wire-contract.md, "Cancelling"): a cancel
message naming its request id, which the engine acts on before its next step, and the cancelled gRPC
call, which the engine notices when it next asks `is_cancelled()`, for models that know no cancel
message. Each request says that it will be cancelled by message (the `sends_cancel_message` parameter),
so our engine asks about it only every second (each question is a round trip to tritonserver, on the
cores the steps use), as a backstop for a frontend that died before it could send the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import (
    InferenceServerException,
    serialize_byte_tensor,
)

from openai_frontend.engine_client import ModelInfo
from openai_frontend.engine_watchdog import DOWN_RETRY_AFTER_S, EngineWatchdog, ProbesUnsupported
from openai_frontend.errors import (
    STUB_DEAD,
    EngineFailure,
    EngineUnavailable,
    FrontendError,
    InvalidRequest,
    ModelNotFound,
    from_engine_message,
)
from protocol import AdmissionGroup, SamplingParams, StepOutput, Task, wire
from protocol.sampling import MAX_TOKEN_ID

FINAL_FLAG = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"


# -- requests -----------------------------------------------------------------------------------


def build_request(
    model: str,
    prompt: str | list[int],
    params: SamplingParams,
    request_id: str,
    admission_group: AdmissionGroup | None = None,
    task: Task = Task.GENERATE,
) -> service_pb2.ModelInferRequest:
    """The ModelInferRequest of the wire contract: text_input or input_ids, plus sampling_params (and
    the admission group's parameters when the request is one of several of a client request); an
    embedding request names its task instead of sampling_params."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    if isinstance(prompt, str):
        _add_bytes_input(request, "text_input", [prompt])
    else:
        if prompt and (min(prompt) < 0 or max(prompt) > MAX_TOKEN_ID):  # numpy would wrap it, or overflow
            raise InvalidRequest(f"prompt token ids must be in [0, {MAX_TOKEN_ID}]", "prompt")
        request.inputs.add(name="input_ids", datatype="INT32", shape=[len(prompt)])
        request.raw_input_contents.append(np.asarray(prompt, dtype=np.int32).tobytes())
    if task is Task.GENERATE:
        _add_bytes_input(request, "sampling_params", [json.dumps(params.to_dict())])
    else:
        _add_bytes_input(request, wire.TASK_INPUT, [task.value])
    request.parameters[EMPTY_FINAL].bool_param = True
    request.parameters[wire.SENDS_CANCEL_MESSAGE].bool_param = True  # (generate's `finally`)
    if admission_group is not None:
        request.parameters[wire.ADMISSION_GROUP].string_param = admission_group.key
        request.parameters[wire.ADMISSION_GROUP_SIZE].int64_param = admission_group.size
    return request


def build_cancel(model: str, request_id: str) -> service_pb2.ModelInferRequest:
    """The cancel message of the wire contract: ends the requests whose id is `request_id`."""
    request = service_pb2.ModelInferRequest(model_name=model, id=f"cancel-{request_id}")
    _add_bytes_input(request, "cancel_request_id", [request_id])
    request.parameters[EMPTY_FINAL].bool_param = True
    return request


def build_probe(model: str) -> service_pb2.ModelInferRequest:
    """The health probe of the wire contract: one `health_probe` input, answered with `health`."""
    request = service_pb2.ModelInferRequest(model_name=model, id="health-probe")
    request.inputs.add(name="health_probe", datatype="BOOL", shape=[1])
    request.raw_input_contents.append(np.array([True]).tobytes())
    request.parameters[EMPTY_FINAL].bool_param = True
    return request


def _add_bytes_input(request: service_pb2.ModelInferRequest, name: str, values: list[str]) -> None:
    request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
    array = np.array([v.encode("utf-8") for v in values], dtype=np.object_)
    request.raw_input_contents.append(serialize_byte_tensor(array).item())


# -- responses ----------------------------------------------------------------------------------


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    params = response.parameters
    return FINAL_FLAG in params and params[FINAL_FLAG].bool_param


def decode_response(response: service_pb2.ModelInferResponse, request_id: str) -> StepOutput | None:
    """One Triton response -> one StepOutput (None for the empty final response).

    Raises EngineFailure (code bad_response) when a tensor of the contract is missing or malformed.
    """
    if len(response.outputs) == 0:
        return None
    try:
        return wire.decode_step(response_outputs(response), request_id, is_final(response))
    except wire.WireError as e:
        raise EngineFailure(f"malformed Triton response: {e}", code="bad_response") from None


def response_outputs(response: service_pb2.ModelInferResponse) -> dict[str, wire.RawTensor]:
    """A response's output tensors by name, as tritonserver sent them (every output as raw bytes)."""
    outputs, raw = response.outputs, response.raw_output_contents
    if len(raw) != len(outputs):
        raise wire.WireError(f"{len(outputs)} outputs but {len(raw)} raw output contents")
    return {output.name: (output.datatype, tuple(output.shape), data) for output, data in zip(outputs, raw)}


def parse_model_config(name: str, config: Any) -> ModelInfo | None:
    """ModelInfo from a Triton ModelConfig protobuf; None when it is not an LLM (model_type != "llm")."""
    params = {key: value.string_value for key, value in config.parameters.items()}
    if params.get("model_type") != "llm":
        return None
    max_len = params.get("max_model_len", "")
    return ModelInfo(
        name=name,
        chat_template=params.get("chat_template") or None,
        bos_token=params.get("bos_token", ""),
        eos_token=params.get("eos_token", ""),
        max_model_len=int(max_len) if max_len.strip().isdigit() else None,
        tokenizer_source=params.get("model") or None,
    )


# -- the client ---------------------------------------------------------------------------------


class _Stream:
    """One ModelStreamInfer call: sends one request and keeps the send side open until `end`.

    Half-closing right after the request would be legal gRPC, but keeping it open until we have
    read the final response leaves no doubt about when the server may end the call.
    """

    def __init__(
        self, stub: Any, request: service_pb2.ModelInferRequest, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> None:
        self._done = asyncio.Event()

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield request
            await self._done.wait()

        self._call = stub.ModelStreamInfer(requests(), metadata=metadata)

    def __aiter__(self) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        return self._call.__aiter__()

    def end(self, cancel: bool) -> None:
        self._done.set()
        if cancel:
            self._call.cancel()


class TritonEngineClient:
    """EngineClient for a Triton server at `url` (host:port of its gRPC endpoint)."""

    def __init__(
        self,
        url: str,
        *,
        config_ttl_s: float = 10.0,
        control_timeout_s: float = 5.0,
        probe_interval_s: float = 1.0,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self.url = url
        # Triton's model-repository API (the model list) answers only with the control key (protocol.wire).
        key = os.environ.get(wire.CONTROL_KEY_ENV)
        self._control_headers = {wire.CONTROL_KEY_GRPC_METADATA: key} if key else None
        self._config_ttl_s = config_ttl_s
        self._timeout = control_timeout_s
        self._client: grpcclient.InferenceServerClient | None = None
        self._configs: dict[str, tuple[float, ModelInfo | None]] = {}
        self._cancels: set[asyncio.Task] = set()  # cancel messages under way
        self.watchdog = EngineWatchdog(self.probe, interval_s=probe_interval_s, timeout_s=probe_timeout_s)

    def _grpc(self) -> grpcclient.InferenceServerClient:
        # Created on first use so the channel belongs to the running event loop.
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url)
        return self._client

    def abort_all(self, reason: str) -> int:
        return self.watchdog.kill_all(reason)

    async def close(self) -> None:
        await self.watchdog.close()
        for task in list(self._cancels):
            task.cancel()
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(TimeoutError):  # bounded: closing never holds a shutdown
                await asyncio.wait_for(client.close(), 5)

    async def ready(self) -> bool:
        try:
            if not await self._grpc().is_server_ready(client_timeout=self._timeout):
                return False
            models = await self.list_models()
            return bool(models) and all([await self.watchdog.alive(m.name) for m in models])
        except (FrontendError, InferenceServerException, grpc.RpcError):
            return False

    async def list_models(self) -> list[ModelInfo]:
        try:
            index = await self._grpc().get_model_repository_index(
                headers=self._control_headers, client_timeout=self._timeout
            )
        except InferenceServerException as e:
            raise self._unavailable(e) from None
        models: dict[str, ModelInfo] = {}
        for entry in index.models:
            if entry.state == "READY" and entry.name not in models:
                info = await self._llm_info(entry.name)
                if info is not None:
                    models[entry.name] = info
        return sorted(models.values(), key=lambda m: m.name)

    async def model_config(self, model: str) -> ModelInfo:
        info = await self._llm_info(model)
        if info is None:
            raise ModelNotFound(model)
        return info

    async def _llm_info(self, name: str) -> ModelInfo | None:
        cached = self._configs.get(name)
        now = time.monotonic()
        if cached is not None and now - cached[0] < self._config_ttl_s:
            return cached[1]
        try:
            response = await self._grpc().get_model_config(name, client_timeout=self._timeout)
        except InferenceServerException as e:
            text = (e.message() or "").lower()
            if "unknown model" in text or "not_found" in (e.status() or "").lower():
                if self.watchdog.knows(name):  # served before: being reloaded, not gone
                    self.watchdog.check(name)
                    raise EngineUnavailable(f"model `{name}` is not loaded in Triton now (restarting?)") from None
                return None
            raise self._unavailable(e) from None
        info = parse_model_config(name, response.config)
        self._configs[name] = (now, info)
        return info

    def _unavailable(self, e: Exception) -> EngineUnavailable:
        message = e.message() if isinstance(e, InferenceServerException) else str(e)
        return EngineUnavailable(f"Triton at {self.url} is not available: {message}")

    def _open_stream(
        self, request: service_pb2.ModelInferRequest, metadata: tuple[tuple[str, str], ...] | None = None
    ) -> _Stream:
        # Tests override this to serve responses without a server.
        return _Stream(self._grpc()._client_stub, request, metadata)

    async def probe(self, model: str) -> str:
        """The id of the engine instance that answers a health probe; raises EngineUnavailable or
        EngineFailure when none does, ProbesUnsupported for a model without the probe input."""
        stream = self._open_stream(build_probe(model))
        try:
            async for response in stream:
                if response.error_message:
                    if "unexpected inference input" in response.error_message:
                        raise ProbesUnsupported(response.error_message)
                    raise from_engine_message(response.error_message)
                health = (
                    InferResult(response.infer_response).as_numpy("health")
                    if len(response.infer_response.outputs)
                    else None
                )
                if health is not None:
                    return str(json.loads(health.reshape(-1)[0])["instance"])
                if is_final(response.infer_response):
                    break
            raise EngineFailure("the health probe got no answer")
        except grpc.aio.AioRpcError as e:
            raise EngineUnavailable(f"Triton at {self.url} is not available: {e.details()}") from None
        finally:
            stream.end(cancel=False)

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        admission_group: AdmissionGroup | None = None,
        task: Task = Task.GENERATE,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StepOutput]:
        self.watchdog.check(model)  # a dead engine: 503 at once
        request = build_request(model, prompt, params, request_id, admission_group, task)
        stream = self._open_stream(request, tuple(headers.items()) if headers else None)
        killed: list[str] = []

        def kill(reason: str) -> None:  # the watchdog found the engine dead: end this stream now
            killed.append(reason)
            stream.end(cancel=True)

        watch = self.watchdog.watch(model, kill)
        complete = False
        try:
            async for response in stream:
                if response.error_message:
                    complete = True  # an error response is the request's last (COMPLETE_FINAL)
                    if STUB_DEAD in response.error_message:
                        self.watchdog.report_dead(model, response.error_message)
                    raise from_engine_message(response.error_message)
                out = decode_response(response.infer_response, request_id)
                # Marked complete before yielding: a consumer that stops after the last output
                # must not cancel a request that already ended.
                complete = is_final(response.infer_response)
                if out is not None:
                    yield out
                if complete:
                    return
            raise EngineFailure("Triton ended the stream before the request's final response")
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            if killed:
                raise EngineUnavailable(killed[0], retry_after_s=DOWN_RETRY_AFTER_S) from None
            if isinstance(e, asyncio.CancelledError):
                raise
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                raise EngineUnavailable(f"Triton at {self.url} is not available: {e.details()}") from None
            raise EngineFailure(f"Triton stream failed: {e.code().name}: {e.details()}") from None
        finally:
            self.watchdog.unwatch(watch)
            # Not complete: the HTTP client went away (CancelledError / aclose) or the stream broke;
            # the engine is told (a cancel message) and the call cancelled, so the engine frees its blocks.
            if not complete and not killed:
                self._send_cancel(model, request_id)
            stream.end(cancel=not complete)

    def _send_cancel(self, model: str, request_id: str) -> None:
        """Sends the cancel message for `request_id` on a call of its own, in the background."""
        try:
            task = asyncio.get_running_loop().create_task(self._cancel(model, request_id))
        except RuntimeError:  # no running loop (the generator was closed at interpreter exit)
            return
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, model: str, request_id: str) -> None:
        stream = self._open_stream(build_cancel(model, request_id))
        try:
            # One empty final response; or an error from a model without the cancel input, for which the
            # cancelled call is what ends the request.
            async for response in stream:
                if response.error_message or is_final(response.infer_response):
                    break
        except grpc.aio.AioRpcError:
            pass  # Triton is gone or going: nothing left to cancel there
        finally:
            stream.end(cancel=False)
