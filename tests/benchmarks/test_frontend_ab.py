"""benchmarks/frontend_ab.py's pure parts: the block order and a process's CPU time."""

from __future__ import annotations

import os
import time

from benchmarks.frontend_ab import block_order, run_time_s


def test_blocks_alternate_a_b_b_a() -> None:
    assert [s for pair in range(4) for s in block_order(pair)] == list("ABBAABBA")


def test_run_time_counts_this_process_s_work() -> None:
    before = run_time_s(os.getpid())
    deadline = time.perf_counter() + 0.05
    while time.perf_counter() < deadline:
        pass
    assert run_time_s(os.getpid()) - before >= 0.03
