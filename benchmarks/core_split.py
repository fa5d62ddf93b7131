"""bench-serve's load with a core kept for the path: the engine on one core, the frontend on another.

    .venv/bin/python -m benchmarks.core_split [--rounds 4] [--triton-cpu engine|path]

On two cores the served engine's two OpenMP threads share both cores with tritonserver, the frontend and
the benchmark client, so the path's CPU lands in the engine's steps. This runs `make bench-serve`'s load
(served and in process, concurrency 1 and 8, no peer) with the engine on one thread, on a core of its own,
and the frontend on another: what the path costs when it takes none of the engine's cores. tritonserver
goes on the engine's core (`engine`, as the launcher's placement does: python_backend's round trip for
each response then stays on one core) or on the frontend's (`path`: the round trip crosses cores). The
in-process side runs one thread as well. Placement is set from outside, on every thread, once the servers
are up; the launcher's own placement is off. Needs two CPUs. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.servers import REPO_ROOT, copy_model_repository, running_servers
from scripts.stub_supervisor import stub_processes


def split_cpus(cpus: set[int]) -> tuple[int, int]:
    """(the path's CPU, the engine's CPU): the lowest and the highest of `cpus`."""
    if len(cpus) < 2:
        raise SystemExit(f"core_split needs two CPUs; this process may use {sorted(cpus)}")
    return min(cpus), max(cpus)


def pin_process(pid: int, cpu: int) -> None:
    """Every thread of `pid` on `cpu` (threads it starts later inherit the mask of the one that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), {cpu})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--triton-cpu", choices=("engine", "path"), default="engine")
    args = parser.parse_args()

    path_cpu, engine_cpu = split_cpus(os.sched_getaffinity(0))
    triton_cpu = engine_cpu if args.triton_cpu == "engine" else path_cpu
    with tempfile.TemporaryDirectory(prefix="core_split") as tmp:
        repo = copy_model_repository(Path(tmp) / "repo", num_threads="1")
        servers = running_servers(Path(tmp) / "logs", model_repository=repo, extra_env={"LLM_CPU_PLACEMENT": "off"})
        with servers as (triton, frontend):
            pin_process(triton.proc.pid, triton_cpu)
            pin_process(frontend.proc.pid, path_cpu)
            for pid in stub_processes(triton.proc.pid):
                pin_process(pid, engine_cpu)
            print(
                f"engine (one thread) on CPU {engine_cpu}, tritonserver on CPU {triton_cpu}, the frontend on CPU "
                f"{path_cpu}; the benchmark client and the in-process engine (one thread) float",
                flush=True,
            )
            bench = [sys.executable, "benchmarks/serve_bench.py", "--url", frontend.url, "--concurrency", "1", "8"]
            bench += ["--rounds", str(args.rounds), "--skip-peer"]
            subprocess.run(bench, env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=REPO_ROOT, check=True)


if __name__ == "__main__":
    main()
