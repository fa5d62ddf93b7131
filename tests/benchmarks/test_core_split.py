"""benchmarks/core_split.py: which CPU gets what, and pinning every thread of another process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.core_split import pin_process, split_cpus


def test_the_path_takes_the_lowest_cpu_and_the_engine_the_highest():
    assert split_cpus({3, 0, 5}) == (0, 5)
    assert split_cpus({0, 1}) == (0, 1)


def test_one_cpu_is_refused_with_what_the_process_may_use():
    with pytest.raises(SystemExit, match=r"needs two CPUs.*\[2\]"):
        split_cpus({2})


def test_every_thread_of_the_process_lands_on_the_cpu():
    cpu = max(os.sched_getaffinity(0))
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "print(flush=True)\n"
        "time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # its threads are running
        pin_process(child.pid, cpu)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 4
        assert all(os.sched_getaffinity(t) == {cpu} for t in tids)
    finally:
        child.kill()
        child.wait()
