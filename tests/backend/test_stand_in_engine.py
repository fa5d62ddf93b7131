"""The stand-in engine of `make bench-wire` keeps the contract the real engine keeps (docs/contract.md)."""

from __future__ import annotations

import threading

from backend.engine_loop import EngineLoop
from backend.stand_in_engine import TOKEN_TEXT, StandInEngine
from protocol import SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants


def vars_of(timings) -> tuple[float, ...]:
    return (timings.queued_s, timings.prefill_s, timings.decode_s)


def run(engine: StandInEngine, requests: dict[str, SamplingParams], abort_after: dict[str, int] | None = None):
    for rid, params in requests.items():
        engine.add_request(engine.make_request(rid, "a b c", params))
    outputs, steps = [], 0
    while engine.has_work():
        outputs += engine.step()
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort_request(rid)
    return outputs


def test_streams_are_exact_with_n_and_seat_limits():
    engine = StandInEngine(step_ms=0, max_num_seqs=3)  # 5 sequences, 3 seats: some wait
    outputs = run(engine, {"a": SamplingParams(n=2, max_tokens=4), "b": SamplingParams(n=3, max_tokens=2)})
    per_seq = check_stream_invariants(outputs, {"a": 2, "b": 3})
    for (rid, _), msgs in per_seq.items():
        want = 4 if rid == "a" else 2
        assert "".join(m.text_delta for m in msgs) == TOKEN_TEXT * want
        assert msgs[-1].finish_reason.value == "length" and msgs[-1].num_output_tokens == want
        assert all(m.timings is None for m in msgs[:-1]) and min(vars_of(msgs[-1].timings)) >= 0
    assert sum(o.request_finished for o in outputs) == 2
    assert engine.stats().generation_tokens == 14


def test_abort_ends_every_sequence_once():
    engine = StandInEngine(step_ms=0, max_num_seqs=8)
    outputs = run(engine, {"a": SamplingParams(n=2, max_tokens=50)}, abort_after={"a": 3})
    per_seq = check_stream_invariants(outputs, {"a": 2})
    assert all(msgs[-1].finish_reason.value == "abort" and msgs[-1].num_output_tokens == 3 for msgs in per_seq.values())


def test_it_runs_under_the_engine_loop_at_its_step_rate():
    engine = StandInEngine(step_ms=5, max_num_seqs=4)
    done, received = threading.Event(), []

    def send(sink, output):
        received.append(output)
        if output.request_finished:
            done.set()

    loop = EngineLoop(lambda: engine, send=send)
    loop.start()
    try:
        loop.submit(engine.make_request("r", "hi", SamplingParams(max_tokens=10)), "sink")
        assert done.wait(10)
    finally:
        loop.stop()
    assert all(isinstance(o, StepOutput) for o in received)
    check_stream_invariants(received, {"r": 1})
