"""What one decoupled python_backend response costs, by the number of output tensors it carries.

    .venv/bin/python -m benchmarks.send_cost [--responses 2000] [--rounds 2]

The real tritonserver serves a throwaway model (written to a temp folder) whose `execute` starts a thread
that sends --responses responses of k INT32 [1] tensors each (k = 1, 2, 4, 6; and 6 with one of them a
BYTES tensor, as our step message has `text_delta`), then a flags-only final response; a tritonclient
gRPC stream reads them all. Printed per k: the time per response as the client sees it (responses are
sent one after another, each `send()` a round trip to tritonserver), and the stub's own p50 times to
build a response (the pb_utils.Tensor objects and the InferenceResponse) and to send it. Our step
message has 6 tensors (docs/wire-contract.md); this says what fewer would save. No model, no engine.
The round trip moves by up to 3x between rounds of the same shape on a VM (whether the two processes'
threads share a core or wake each other across two): read the build times, and several rounds.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from scripts.servers import TritonServer, free_port

MODEL = "send_cost"
CONFIG = """name: "send_cost"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "plan" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [
  { name: "o0" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "o1" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "o2" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "o3" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "o4" data_type: TYPE_INT32 dims: [ -1 ] }, { name: "o5" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "text" data_type: TYPE_STRING dims: [ -1 ] }, { name: "stub_us" data_type: TYPE_INT32 dims: [ 2 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
# The stub runs the base interpreter: the venv's numpy (<2, what the stub's bindings expect) goes first,
# as in our own model.py.
MODEL_PY = """import os, sys, threading, time
sys.path.insert(0, os.environ["LLM_SERVING_SITE_PACKAGES"])
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            n, k, text = (int(v) for v in pb_utils.get_input_tensor_by_name(request, "plan").as_numpy())
            threading.Thread(target=self.send_all, args=(request.get_response_sender(), n, k, text)).start()
        return None

    def send_all(self, sender, n, k, text):
        build, send = [], []
        for i in range(n):
            t0 = time.perf_counter()
            tensors = [pb_utils.Tensor(f"o{j}", np.array([i], dtype=np.int32)) for j in range(k - text)]
            if text:
                tensors.append(pb_utils.Tensor("text", np.array([b"hello"], dtype=np.object_)))
            response = pb_utils.InferenceResponse(output_tensors=tensors)
            t1 = time.perf_counter()
            sender.send(response)
            send.append(time.perf_counter() - t1)
            build.append(t1 - t0)
        us = np.array([np.median(build) * 1e6, np.median(send) * 1e6], dtype=np.int32)
        sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("stub_us", us)]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""


def measure(client: grpcclient.InferenceServerClient, results: queue.Queue, n: int, k: int, text: int) -> dict:
    plan = grpcclient.InferInput("plan", [3], "INT32")
    plan.set_data_from_numpy(np.array([n, k, text], dtype=np.int32))
    start = time.perf_counter()
    client.async_stream_infer(MODEL, [plan])
    received = 0
    while True:
        result, error = results.get(timeout=60)
        if error is not None:
            raise RuntimeError(str(error))
        response = result.get_response()
        names = [o.name for o in response.outputs]
        if "stub_us" in names:
            build_us, send_us = np.frombuffer(response.raw_output_contents[names.index("stub_us")], dtype=np.int32)
            break
        received += 1
    elapsed = time.perf_counter() - start
    assert received == n, f"{received} of {n} responses"
    return {"tensors": k, "bytes_tensor": bool(text), "us_per_response": round(1e6 * elapsed / n, 1),
            "stub_build_us_p50": int(build_us), "stub_send_us_p50": int(send_us)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp())
    (folder / MODEL / "1").mkdir(parents=True)
    (folder / MODEL / "config.pbtxt").write_text(CONFIG)
    (folder / MODEL / "1" / "model.py").write_text(MODEL_PY)
    server = TritonServer(free_port(), free_port(), free_port(), model_repository=folder, supervise=False)
    try:
        server.start(folder / "tritonserver.log")
        client = grpcclient.InferenceServerClient(server.grpc_url)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for _ in range(args.rounds):  # the shapes alternate, so a drifting machine touches them all alike
            for k, text in [(1, 0), (2, 0), (4, 0), (6, 0), (6, 1)]:
                row = measure(client, results, args.responses, k, text)
                print(f"{k} tensors{' (one BYTES)' if text else ''}: {row['us_per_response']} us per response at "
                      f"the client; stub: build {row['stub_build_us_p50']} us, send() {row['stub_send_us_p50']} us "
                      "(p50)", flush=True)  # fmt: skip
        client.stop_stream()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
