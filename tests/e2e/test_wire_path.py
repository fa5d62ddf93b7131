"""The response path under backpressure, on the real servers: a stand-in engine (no model) makes
tokens faster than the path carries them, the model's sender joins each sequence's pending steps
(docs/contract.md, "Joined steps"), and every stream still arrives exact: through the frontend's
SSE, and straight from Triton's gRPC stream as any tritonclient user reads it."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.serve_profile import process_threads
from benchmarks.wire_bench import TEXT, run_level, stand_in_repository
from scripts.servers import DEFAULT_MODEL
from tests.e2e.helpers import running_servers
from tests.e2e.triton_stream import check_invariants, stream_generate

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repository = stand_in_repository(tmp_path_factory.mktemp("stand-in"), step_ms=1.0, max_num_seqs=256)
    with running_servers(repository, "wire", supervise=False) as servers:
        yield servers


def test_sse_streams_stay_exact_when_responses_join_steps(servers):
    _, frontend = servers
    stats = asyncio.run(run_level(frontend.host, frontend.port, concurrency=64, max_tokens=96, seconds=2.0))
    assert stats["streams"] >= 64 and stats["exact"] == stats["streams"], stats["errors"]
    assert stats["chunks"] < stats["tokens"]  # some SSE chunks carried several steps' tokens


async def test_grpc_clients_get_every_token_in_step_ranges(servers):
    triton, _ = servers
    params = {"n": 2, "max_tokens": 300}
    results = await asyncio.gather(
        *(stream_generate(triton.grpc_url, DEFAULT_MODEL, f"prompt {i}", params) for i in range(48))
    )
    for result in results:
        check_invariants(result, n=2, max_tokens=300)  # steps contiguous as ranges, one finish, counts
        for seq in result.by_seq().values():
            assert "".join(r.text_delta for r in seq) == TEXT * 300
    assert any(r.num_steps > 1 for result in results for r in result.responses)


def _thread_switches(pid: int) -> dict[str, int]:
    """Context switches (voluntary and not) per thread name of a process."""
    totals: dict[str, int] = {}
    for thread in process_threads(pid):
        totals[thread.name] = totals.get(thread.name, 0) + thread.voluntary_switches + thread.involuntary_switches
    return totals


def test_the_frontend_reads_triton_responses_without_grpcs_event_engine_threads(servers):
    """Each streamed token wakes the frontend's gRPC poller thread and its event loop, and no other thread
    (openai_frontend/settings.GRPC_EXPERIMENTS): grpcio's EventEngine client would hand every message
    through threads of its own first."""
    _, frontend = servers
    before = _thread_switches(frontend.proc.pid)
    stats = asyncio.run(run_level(frontend.host, frontend.port, concurrency=1, max_tokens=200, seconds=0.5))
    after = _thread_switches(frontend.proc.pid)
    assert stats["exact"] == stats["streams"] >= 1, stats["errors"]
    assert "event_engine" in after  # (gRPC still starts them, for its timers: the test can tell them apart)
    event_engine = after["event_engine"] - before.get("event_engine", 0)
    assert event_engine < stats["chunks"] / 4, (event_engine, stats["chunks"], after)
