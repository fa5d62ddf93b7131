"""The engine loop thread and the sender thread, without Triton (sinks are plain objects)."""

from __future__ import annotations

import threading
import time

from backend.engine_loop import EngineLoop
from backend.types import RequestFailure, SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants, tiny_engine


class Sink:
    def __init__(self) -> None:
        self.outputs: list = []
        self.done = threading.Event()
        self.cancelled = False


def send(sink: Sink, output) -> None:
    sink.outputs.append(output)
    if isinstance(output, RequestFailure) or output.request_finished:
        sink.done.set()


def test_requests_stream_to_their_own_sinks_and_cancellation_aborts():
    engine = tiny_engine()
    loop = EngineLoop(engine, send=send, is_cancelled=lambda s: s.cancelled)
    loop.start()
    try:
        sinks = {}
        for i in range(4):
            sinks[f"r{i}"] = Sink()
            params = SamplingParams(n=1 + i % 2, max_tokens=5 + i, ignore_eos=True)
            loop.submit(engine.make_request(f"r{i}", f"prompt {i}", params), sinks[f"r{i}"])
        slow = Sink()
        loop.submit(engine.make_request("slow", "x", SamplingParams(max_tokens=400, ignore_eos=True)), slow)
        for i in range(4):
            assert sinks[f"r{i}"].done.wait(30)
            check_stream_invariants(sinks[f"r{i}"].outputs, {f"r{i}": 1 + i % 2})
            assert all(o.request_id == f"r{i}" for o in sinks[f"r{i}"].outputs)
        slow.cancelled = True
        assert slow.done.wait(30)
        assert slow.outputs[-1].finish_reason.value == "abort"
        deadline = time.monotonic() + 5
        while engine.block_manager.stats().used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.block_manager.stats().used == 0
    finally:
        loop.stop()


def test_duplicate_request_id_is_refused_with_an_error_and_others_go_on():
    engine = tiny_engine()
    loop = EngineLoop(engine, send=send)
    loop.start()
    try:
        first, second = Sink(), Sink()
        loop.submit(engine.make_request("same", "a", SamplingParams(max_tokens=50, ignore_eos=True)), first)
        loop.submit(engine.make_request("same", "b", SamplingParams(max_tokens=2)), second)
        assert second.done.wait(30) and first.done.wait(30)
        assert (
            isinstance(second.outputs[-1], RequestFailure) and second.outputs[-1].error_type == "invalid_request_error"
        )
        assert isinstance(first.outputs[-1], StepOutput) and first.outputs[-1].num_output_tokens == 50
    finally:
        loop.stop()
