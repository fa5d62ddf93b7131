"""The served CPU engine's placement (backend/cpu_placement.py) on the real processes: tritonserver on the
first CPU, the engine's OpenMP team bound one thread per CPU with its master on that same CPU."""

from __future__ import annotations

import os

import openai
import pytest

from backend.cpu_placement import PLACEMENT_ENV
from scripts.stub_supervisor import stub_processes

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: nothing to place"),
    pytest.mark.skipif(os.environ.get(PLACEMENT_ENV) == "off", reason=f"{PLACEMENT_ENV}=off"),
]


def thread_cpus(pid: int) -> dict[int, list[int]]:
    """tid -> the CPUs it may run on."""
    cpus = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpus[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:  # (a thread that just ended)
            continue
    return cpus


def test_tritonserver_shares_the_engine_masters_cpu_and_the_workers_have_the_rest(servers):
    client = openai.OpenAI(base_url=servers.base_url, api_key="unused")
    client.completions.create(model=servers.model, prompt="Placement", max_tokens=4)  # the team exists now
    ours = sorted(os.sched_getaffinity(0))
    path_cpu = ours[0]

    triton = thread_cpus(servers.triton.proc.pid)
    assert triton and all(cpus == [path_cpu] for cpus in triton.values()), triton

    (stub,) = [pid for pid, model in stub_processes(servers.triton.proc.pid).items() if model == servers.model]
    stub_threads = thread_cpus(stub)
    # The stub's threads started before model.py widened its mask keep tritonserver's CPU, and libgomp
    # binds the main thread (so the engine thread it starts) there too: only the OpenMP workers run on
    # the other CPUs, each bound to one.
    assert {cpu for cpus in stub_threads.values() for cpu in cpus} == set(ours), stub_threads
    bound = {cpus[0] for cpus in stub_threads.values() if len(cpus) == 1}
    assert bound == set(ours), stub_threads  # a worker on each other CPU; the master with tritonserver
