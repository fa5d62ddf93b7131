"""A one-minute soak (`make soak` runs ten): mixed traffic against the shared real servers, every
stream checked as a client would, then nothing left over once idle."""

from __future__ import annotations

import pytest

from benchmarks.soak import soak
from scripts.stub_supervisor import stub_processes

pytestmark = pytest.mark.slow


async def test_one_minute_of_mixed_traffic_leaves_nothing_behind(servers):
    stub = next(iter(stub_processes(servers.triton.proc.pid)))
    result = await soak(
        servers.frontend.url,
        servers.triton.metrics_url,
        servers.model,
        seconds=60,
        concurrency=6,
        seed=1,
        frontend_pid=servers.frontend.proc.pid,
        stub_pid=stub,
    )
    assert result["errors"] == {} and result["violations"] == 0, result
    assert result["kv_blocks_in_use"] == 0, result
    assert result["ok"] > 50 and result["expected_errors"].get("disconnect"), result
    assert all(rss[1] is not None for rss in result["rss_mb"].values())
