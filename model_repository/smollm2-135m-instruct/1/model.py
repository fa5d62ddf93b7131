"""Triton Python-backend model (decoupled): a thin adapter between Triton tensors and the engine.

`execute` only parses and enqueues; the engine runs on its own thread (backend/engine_loop.py) and
a sender thread turns each StepOutput into one response: one response per sequence per step.
The tensor names are the wire contract of docs/wire-contract.md.
"""

import itertools
import json
import os
import site
import sys
import uuid
from pathlib import Path

# The stub runs the base interpreter: make the project's venv and repo importable before torch.
_REPO_ROOT = Path(os.environ.get("LLM_SERVING_REPO_ROOT") or Path(__file__).resolve().parents[3])
_SITE = os.environ.get("LLM_SERVING_SITE_PACKAGES") or next(
    iter(sorted((_REPO_ROOT / ".venv" / "lib").glob("python3*/site-packages"))), None
)
if _SITE and str(_SITE) not in sys.path:  # (already there when the venv's own python runs this file)
    _before = list(sys.path)
    site.addsitedir(str(_SITE))  # also runs the venv's .pth files
    sys.path[:] = [p for p in sys.path if p not in _before] + [p for p in _before if p != str(_SITE)]
sys.path.insert(0, str(_REPO_ROOT))

# torch's OpenMP workers (libgomp) spin up to GOMP_SPINCOUNT times waiting for the next parallel region;
# the default, 300,000 `pause`s, is milliseconds of a core each time the engine thread runs Python between
# regions or steps, taken from tritonserver, the frontend and this stub's sender, which share the cores.
# 10,000 stops spinning within a millisecond (measurements: docs/benchmarking.md). libgomp reads it when it
# loads, with torch in initialize(); a setting of the user's wins.
if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from backend.config import EngineConfig, instance_settings  # noqa: E402
from backend.cpu_placement import place_engine  # noqa: E402
from backend.engine_loop import EngineLoop, StepTrace  # noqa: E402
from protocol import (  # noqa: E402
    EngineOutput,
    InvalidRequestError,
    RequestFailure,
    SamplingParams,
    StepOutput,
    wire,
)

_GAUGES = {
    "num_running": "Sequences in the running batch",
    "num_waiting": "Sequences waiting to be scheduled",
    "kv_blocks_used": "KV cache blocks in use",
    "kv_blocks_free": "KV cache blocks free (including cached ones)",
    "kv_blocks_cached": "Free KV cache blocks that still hold a reusable prefix",
    "prefix_cache_hit_ratio": "Prompt tokens found in the prefix cache over tokens looked up, since start",
}
_COUNTERS = {
    "prompt_tokens": "Prompt tokens received",
    "generation_tokens": "Tokens generated",
    "num_preemptions": "Sequences preempted (recomputed later)",
    "aborted_requests": "Requests aborted (client cancelled)",
    "rejected_requests": "Requests refused because too many sequences were waiting (max_waiting_seqs)",
}


class TritonPythonModel:
    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        kind, cpu_instances = args.get("model_instance_kind", "CPU"), _cpu_instances(model_config)
        place_engine(kind, cpu_instances)  # before torch loads (backend/cpu_placement.py)
        params.update(_placement(kind, cpu_instances, params))
        config = EngineConfig.from_strings(params)
        # Names this instance's life: a probe that sees another one knows the engine was restarted.
        self.instance_id = f"{args['model_instance_name']}-{uuid.uuid4().hex[:12]}"
        self._ids = itertools.count()
        self._init_metrics(args["model_name"], args["model_instance_name"])
        trace_path = os.environ.get("LLM_STEP_TRACE")  # benchmarks/serve_profile.py sets it
        gpu = int(args["model_instance_device_id"]) if args.get("model_instance_kind") == "GPU" else None

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
            send=self._send,
            is_cancelled=lambda s: s.is_cancelled(),
            on_stats=self._publish_stats,
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
                prompt, params = self._parse(request)
                key = request.request_id() or None  # what a cancel message names it by
                parameters = request.parameters()
                self.loop.submit(
                    self.engine.make_request(request_id, prompt, params),
                    sender,
                    key,
                    wire.sends_cancel_message(parameters),
                    wire.admission_group(parameters),
                )
            except InvalidRequestError as e:
                self._send(sender, RequestFailure.refused(request_id, e))
            except Exception as e:  # noqa: BLE001 - a malformed request must not crash the stub
                self._send(sender, RequestFailure(request_id, f"{type(e).__name__}: {e}", "invalid_request_error"))
        return None

    def finalize(self):
        self.loop.stop()

    def _answer_probe(self, sender, request_id):
        """A health probe (docs/wire-contract.md): answered here, on Triton's thread, without the engine."""
        if not self.loop.is_running():
            self._send(sender, RequestFailure(request_id, "the engine loop is not running"))
            return
        health = json.dumps({"instance": self.instance_id, "engine": "running"})
        tensor = pb_utils.Tensor("health", np.array([health.encode()], dtype=np.object_))
        sender.send(
            pb_utils.InferenceResponse(output_tensors=[tensor]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        )

    # -- Triton tensors <-> engine types ------------------------------------------------------

    @staticmethod
    def _parse(request):
        text = pb_utils.get_input_tensor_by_name(request, "text_input")
        ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if (text is None) == (ids is None):
            raise InvalidRequestError("give exactly one of text_input and input_ids", "text_input")
        prompt = _one_string(text, "text_input") if text is not None else [int(t) for t in ids.as_numpy().reshape(-1)]
        sp = pb_utils.get_input_tensor_by_name(request, "sampling_params")
        if sp is None:
            return prompt, SamplingParams()
        return prompt, SamplingParams.from_json(_one_string(sp, "sampling_params"))

    @staticmethod
    def _send(sender, output: EngineOutput) -> None:
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

    # -- metrics ------------------------------------------------------------------------------

    def _init_metrics(self, model_name, instance_name):
        labels = {"model": model_name, "instance": instance_name}
        kind = pb_utils.MetricFamily
        # The families must outlive their metrics, so keep them too.
        self._families = {
            name: kind(name=f"llm_{name}", description=desc, kind=kind.GAUGE) for name, desc in _GAUGES.items()
        }
        self._families.update(
            {
                name: kind(name=f"llm_{name}_total", description=desc, kind=kind.COUNTER)
                for name, desc in _COUNTERS.items()
            }
        )
        self._gauges = {name: self._families[name].Metric(labels=labels) for name in _GAUGES}
        self._counters = {name: self._families[name].Metric(labels=labels) for name in _COUNTERS}
        self._last_counts = dict.fromkeys(_COUNTERS, 0)
        self._last_gauges: dict[str, float] = {}

    def _publish_stats(self, stats) -> None:  # backend.engine.EngineStats
        # Each set() and increment() is a round trip to tritonserver on the engine thread: only changes go.
        for name, metric in self._gauges.items():
            if name == "prefix_cache_hit_ratio":
                value = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            else:
                value = getattr(stats, name)
            value = float(value)
            if self._last_gauges.get(name) != value:
                metric.set(value)
                self._last_gauges[name] = value
        for name, metric in self._counters.items():
            value = getattr(stats, name)
            if value > self._last_counts[name]:
                metric.increment(float(value - self._last_counts[name]))
                self._last_counts[name] = value


def _cpu_instances(model_config):
    return sum(
        int(g.get("count", 1))
        for g in model_config.get("instance_group", [])
        if g.get("kind", "KIND_CPU") == "KIND_CPU"
    )


def _placement(kind, cpu_instances, params):
    """This instance's share of the machine (backend.config.instance_settings): KIND_GPU instances on
    CUDA (each on its own device: initialize's build_engine), CPU instances splitting the cores."""
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
