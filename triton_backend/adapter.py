"""Triton requests in, engine responses out: one response per sequence per engine step.

`execute` only parses tensors and enqueues: requests are made (tokenized, validated) on the input
stage's threads and the engine runs on its own (backend/engine_loop.py), which hands each StepOutput
to a sender as one response. So a health probe is answered at once, however long another request
takes to make. The tensor names are the wire contract of docs/wire-contract.md.
"""

import functools
import itertools
import json
import os
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.config import EngineConfig, instance_settings
from backend.cpu_placement import place_engine
from backend.engine_loop import EngineLoop, StepTrace
from protocol import EngineOutput, InvalidRequestError, RequestFailure, SamplingParams, StepOutput, wire
from triton_backend.metrics import EngineMetrics


class EngineAdapter:
    """One model instance: its engine loop, its metrics, and the Triton side of every request."""

    def __init__(self, args) -> None:
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        kind, cpu_instances = args.get("model_instance_kind", "CPU"), _cpu_instances(model_config)
        quiet_openmp_spinning()  # both before torch loads (backend/cpu_placement.py)
        place_engine(kind, cpu_instances)
        params.update(_placement(kind, cpu_instances, params))
        config = EngineConfig.from_strings(params)
        # Names this instance's life: a probe that sees another one knows the engine was restarted.
        self.instance_id = f"{args['model_instance_name']}-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()
        self.metrics = EngineMetrics(args["model_name"], args["model_instance_name"])
        trace_path = os.environ.get("LLM_STEP_TRACE")  # benchmarks/serve_profile.py sets it
        gpu = int(args["model_instance_device_id"]) if kind == "GPU" else None

        def build_engine():  # on the loop's thread, which then steps it (see EngineLoop)
            if params.get("engine") == "stand-in":  # no model: measures the response path (make bench-wire)
                from backend.stand_in_engine import StandInEngine

                return StandInEngine(float(params.get("stand_in_step_ms", "20")), config.max_num_seqs)
            from backend.engine import LLMEngine  # (torch: loaded once placement is done)

            if gpu is not None:
                import torch

                torch.cuda.set_device(gpu)  # the current device is per thread
            return LLMEngine(config)

        self.loop = EngineLoop(
            build_engine,
            send=send,
            is_cancelled=lambda sender: sender.is_cancelled(),
            on_stats=self.metrics.publish,
            trace=StepTrace(f"{trace_path}.{args['model_instance_name']}") if trace_path else None,
            stream_interval=config.stream_interval,
        )
        self.engine = self.loop.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
            if pb_utils.get_input_tensor_by_name(request, "health_probe") is not None:
                self._answer_probe(sender, request_id)
                continue
            try:
                cancel = pb_utils.get_input_tensor_by_name(request, "cancel_request_id")
                if cancel is not None:  # (docs/wire-contract.md) answered at once, with a flags-only final response
                    self.loop.cancel(_one_string(cancel, "cancel_request_id"))
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                prompt, params, task = _parse(request)
                key = request.request_id() or None  # what a cancel message names it by
                parameters = request.parameters()
                self.loop.make_and_submit(  # made on the input stage's threads: probes never wait for it
                    request_id,
                    functools.partial(self.engine.make_request, request_id, prompt, params, task),
                    sender,
                    key,
                    wire.sends_cancel_message(parameters),
                    wire.admission_group(parameters),
                )
            except InvalidRequestError as e:
                send(sender, RequestFailure.refused(request_id, e))
            except Exception as e:  # noqa: BLE001 - a malformed request must not crash the stub
                send(sender, RequestFailure(request_id, f"{type(e).__name__}: {e}", "invalid_request_error"))
        return None

    def finalize(self):
        self.loop.stop()

    def _answer_probe(self, sender, request_id):
        """A health probe (docs/wire-contract.md): answered here, on Triton's thread, without the engine."""
        if not self.loop.is_running():
            send(sender, RequestFailure(request_id, "the engine loop is not running"))
            return
        health = json.dumps({"instance": self.instance_id, "engine": "running"})
        tensor = pb_utils.Tensor("health", np.array([health.encode()], dtype=np.object_))
        sender.send(
            pb_utils.InferenceResponse(output_tensors=[tensor]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )


def quiet_openmp_spinning() -> None:
    """torch's OpenMP workers (libgomp) spin GOMP_SPINCOUNT times waiting for the next parallel region; with
    libgomp's default they take a core from tritonserver, the frontend and the sender for milliseconds each
    time the engine thread runs Python between regions, and a short spin stops within a millisecond
    (docs/performance.md). libgomp reads it when torch loads, so this runs first; a user's setting wins."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = "10000"


# -- Triton tensors <-> protocol types --------------------------------------------------------


def _parse(request):
    text = pb_utils.get_input_tensor_by_name(request, "text_input")
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequestError("give exactly one of text_input and input_ids", "text_input")
    prompt = _one_string(text, "text_input") if text is not None else [int(t) for t in ids.as_numpy().reshape(-1)]
    task_input = pb_utils.get_input_tensor_by_name(request, wire.TASK_INPUT)
    task = wire.task(None if task_input is None else _one_string(task_input, wire.TASK_INPUT))
    sp = pb_utils.get_input_tensor_by_name(request, "sampling_params")
    if sp is None:
        return prompt, SamplingParams(), task
    return prompt, SamplingParams.from_json(_one_string(sp, "sampling_params")), task


def send(sender, output: EngineOutput) -> None:
    """One engine output as one response; the request's last carries COMPLETE_FINAL."""
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if isinstance(output, RequestFailure):
        message = json.dumps(
            {"type": output.error_type, "message": output.message, "param": output.param, "code": output.code}
        )
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=final)
        return
    sender.send(
        pb_utils.InferenceResponse(output_tensors=_step_tensors(output)),
        flags=final if output.request_finished else 0,
    )


def _cpu_instances(model_config):
    return sum(
        int(g.get("count", 1))
        for g in model_config.get("instance_group", [])
        if g.get("kind", "KIND_CPU") == "KIND_CPU"
    )


def _placement(kind, cpu_instances, params):
    """This instance's share of the machine (backend.config.instance_settings): KIND_GPU instances on
    CUDA (each on its own device: build_engine), CPU instances splitting the cores."""
    import torch

    return instance_settings(params, kind, cpu_instances, torch.get_num_threads())  # torch's default: one per core


def _one_string(tensor, name):
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(f"{name} must hold exactly one string", name)
    raw = values[0]
    return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)


def _step_tensors(out: StepOutput):
    return [pb_utils.Tensor(name, array) for name, array in wire.encode_step(out).items()]
