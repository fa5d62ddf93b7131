"""`make serve`: start the real tritonserver and the OpenAI frontend, print the URL, stop both on Ctrl-C.

Ports come from the environment: FRONTEND_PORT (9000), TRITON_HTTP_PORT (8000),
TRITON_GRPC_PORT (8001), TRITON_METRICS_PORT (8002); addresses from FRONTEND_HOST and TRITON_ADDRESS
(127.0.0.1). `--only triton` runs tritonserver alone, with its stub supervisor (a container of a
Triton pool: docker/compose.yaml, deploy/k8s/); the frontend then runs on its own
(`python -m openai_frontend --triton-url ...`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from scripts.servers import DEFAULT_MODEL, REPO_ROOT, Frontend, TritonServer


def _port(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scripts.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["triton"], default=None, help="run tritonserver (and its supervisor) alone")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs = REPO_ROOT / "artifacts" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    triton = TritonServer(
        http_port=_port("TRITON_HTTP_PORT", 8000),
        grpc_port=_port("TRITON_GRPC_PORT", 8001),
        metrics_port=_port("TRITON_METRICS_PORT", 8002),
        address=os.environ.get("TRITON_ADDRESS", "127.0.0.1"),
    )
    frontend = Frontend(
        triton.grpc_url, port=_port("FRONTEND_PORT", 9000), host=os.environ.get("FRONTEND_HOST", "127.0.0.1")
    )
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        print("\nstopping the frontend and tritonserver ...", flush=True)
        frontend.stop()
        triton.stop()

    signal.signal(signal.SIGINT, lambda *a: stop())
    signal.signal(signal.SIGTERM, lambda *a: stop())
    only_triton = args.only == "triton"
    try:
        if only_triton:  # a container's process: the logs go to its stdout
            print(f"starting tritonserver on {triton.address} ...", flush=True)
            triton.start(log_path=None)
        else:
            print(f"starting tritonserver (log: {logs / 'tritonserver.log'}) ...", flush=True)
            triton.start(log_path=logs / "tritonserver.log")
            print(f"starting the OpenAI frontend (log: {logs / 'frontend.log'}) ...", flush=True)
            frontend.start(log_path=logs / "frontend.log")
    except (RuntimeError, TimeoutError) as e:
        if stopping:  # Ctrl-C / SIGTERM while starting: what ended the start-up was our own stop
            return 0
        print(f"failed to start: {e}", file=sys.stderr)
        stop()
        return 1
    if stopping:  # the signal came just as the last process became ready
        return 0
    if only_triton:
        print(
            f"Triton ready: gRPC {triton.grpc_port}, HTTP {triton.http_port}, metrics {triton.metrics_port}", flush=True
        )
        return _wait(lambda: stopping, [triton], stop)
    print(f"\nOpenAI API: {frontend.url}/v1   (model: {DEFAULT_MODEL})", flush=True)
    print(f"Triton: gRPC {triton.grpc_url}, HTTP http://127.0.0.1:{triton.http_port}, metrics {triton.metrics_url}")
    if triton.placement is not None:
        cpu, engine_cpus = triton.placement
        cpus = ",".join(map(str, engine_cpus))
        print(f"CPUs: tritonserver on {cpu}, the engine on {cpus} (LLM_CPU_PLACEMENT=off: all float)")
    print(
        f"Try: curl -N {frontend.url}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model":"{DEFAULT_MODEL}","prompt":"The capital of France is","max_tokens":16,"stream":true}}\''
    )
    print("Ctrl-C stops both.", flush=True)
    return _wait(lambda: stopping, [triton, frontend], stop)


def _wait(stopping, procs, stop) -> int:
    """Until a signal stops everything (0), or one process exits on its own (1: the others are stopped)."""
    while not stopping():
        for proc in procs:
            if proc.proc is not None and proc.proc.poll() is not None:
                print(f"{proc.name} exited with {proc.proc.returncode}; see its log", file=sys.stderr)
                stop()
                return 1
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
