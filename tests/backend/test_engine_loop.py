"""The engine thread, the response sender and the cancel watcher, without Triton (sinks are plain objects)."""

from __future__ import annotations

import threading
import time

import pytest

from backend import cancel_watcher, engine_thread
from backend.engine_loop import EngineLoop, StepTrace
from protocol import RequestFailure, SamplingParams, StepOutput
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
    loop = EngineLoop(lambda: engine, send=send, is_cancelled=lambda s: s.cancelled)
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


def test_a_cancel_by_key_aborts_that_keys_requests_without_asking_the_sinks():
    # The frontend tells the engine its client went away; nothing waits for the watcher's next question.
    engine = tiny_engine(num_kv_blocks=256)
    loop = EngineLoop(lambda: engine, send=send, is_cancelled=lambda sink: False)
    loop.start()
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        gone, other, unkeyed = Sink(), Sink(), Sink()
        two = SamplingParams(n=2, max_tokens=400, ignore_eos=True)
        loop.submit(engine.make_request("gone-0", "x", two), gone, "k1")
        loop.submit(engine.make_request("other-1", "y", params), other, "k2")
        loop.submit(engine.make_request("unkeyed-2", "z", params), unkeyed)
        while len(gone.outputs) < 4:
            time.sleep(0.005)
        loop.cancel("no-such-key")  # ignored
        loop.cancel("k1")
        assert gone.done.wait(10)
        last = {o.seq_index: o for o in gone.outputs}
        assert {i: o.finish_reason.value for i, o in last.items()} == {0: "abort", 1: "abort"}
        assert gone.outputs[-1].request_finished
        check_stream_invariants(gone.outputs, {"gone-0": 2})
        time.sleep(0.05)
        assert not other.done.is_set() and not unkeyed.done.is_set()  # other keys, and no key, go on
        loop.cancel("k1")  # its requests are gone: nothing else is touched
        loop.cancel("k2")
        assert other.done.wait(10) and other.outputs[-1].finish_reason.value == "abort"
        assert not unkeyed.done.is_set()
        assert unkeyed.done.wait(30) and unkeyed.outputs[-1].finish_reason.value == "length"
    finally:
        loop.stop()


def test_cancellation_is_asked_of_a_few_requests_per_poll_in_turn(monkeypatch):
    # Each question is a round trip to tritonserver: beyond the budget, requests are asked in turn.
    monkeypatch.setattr(cancel_watcher, "CANCEL_CHECKS_PER_POLL", 2)
    monkeypatch.setattr(cancel_watcher, "CANCEL_POLL_S", 0.001)
    engine = tiny_engine()
    asked: list[Sink] = []
    asked_on: set[str] = set()

    def is_cancelled(sink: Sink) -> bool:
        asked.append(sink)
        asked_on.add(threading.current_thread().name)
        return sink.cancelled

    loop = EngineLoop(lambda: engine, send=send, is_cancelled=is_cancelled)
    per_poll: list[int] = []
    poll = loop._watcher.poll

    def counted_poll():
        before = len(asked)
        poll()
        per_poll.append(len(asked) - before)

    loop._watcher.poll = counted_poll
    loop.start()
    try:
        sinks = [Sink() for _ in range(5)]
        for i, sink in enumerate(sinks):
            loop.submit(engine.make_request(f"r{i}", "x", SamplingParams(max_tokens=400, ignore_eos=True)), sink)
        deadline = time.monotonic() + 30
        while not all(sink.outputs for sink in sinks) and time.monotonic() < deadline:
            time.sleep(0.005)
        for sink in sinks:
            sink.cancelled = True
        assert all(sink.done.wait(30) for sink in sinks)
        assert all(sink.outputs[-1].finish_reason.value == "abort" for sink in sinks)
        assert max(per_poll) == 2  # the budget binds, and no poll asks more
        assert asked_on == {"cancel-watcher"}  # each question is a round trip: never on the engine thread
    finally:
        loop.stop()


def test_requests_whose_client_sends_cancel_messages_are_asked_only_as_a_backstop(monkeypatch):
    # Each question takes the cores the steps use; such a client ends its requests by message.
    from backend.stand_in_engine import StandInEngine

    monkeypatch.setattr(cancel_watcher, "CANCEL_POLL_S", 0.002)
    monkeypatch.setattr(cancel_watcher, "CANCEL_BACKSTOP_S", 0.25)
    engine = StandInEngine(step_ms=5.0, max_num_seqs=8)  # requests that last until the test ends them
    asked: dict[int, int] = {}
    lock = threading.Lock()

    def is_cancelled(sink: Sink) -> bool:
        with lock:
            asked[id(sink)] = asked.get(id(sink), 0) + 1
        return sink.cancelled

    loop = EngineLoop(lambda: engine, send=send, is_cancelled=is_cancelled)
    loop.start()
    try:
        by_message, polled, unkeyed = Sink(), Sink(), Sink()
        params = SamplingParams(max_tokens=1_000_000)
        start = time.monotonic()
        loop.submit(engine.make_request("m", "x", params), by_message, "k-m", sends_cancel_message=True)
        loop.submit(engine.make_request("p", "x", params), polled, "k-p")
        # Without a key no message can name it: it is asked as often as any.
        loop.submit(engine.make_request("u", "x", params), unkeyed, None, sends_cancel_message=True)
        deadline = start + 30
        while min(asked.get(id(polled), 0), asked.get(id(unkeyed), 0)) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        assert min(asked.get(id(polled), 0), asked.get(id(unkeyed), 0)) >= 40
        assert asked.get(id(by_message), 0) <= elapsed / 0.25 + 2
        # The backstop still finds a client that went away without a message.
        by_message.cancelled = True
        assert by_message.done.wait(30) and by_message.outputs[-1].finish_reason.value == "abort"
        loop.cancel("k-p")
        unkeyed.cancelled = True
        assert polled.done.wait(30) and unkeyed.done.wait(30)
        assert polled.outputs[-1].finish_reason.value == unkeyed.outputs[-1].finish_reason.value == "abort"
    finally:
        loop.stop()


def test_duplicate_request_id_is_refused_with_an_error_and_others_go_on():
    engine = tiny_engine()
    loop = EngineLoop(lambda: engine, send=send)
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


def test_the_engine_is_built_and_stepped_on_the_loop_thread():
    # One thread runs all of the engine's torch work (see EngineLoop): building it too.
    built_on, stepped_on = [], set()

    def build():
        built_on.append(threading.get_ident())
        engine = tiny_engine()
        real_step = engine.step
        engine.step = lambda: stepped_on.add(threading.get_ident()) or real_step()
        return engine

    loop = EngineLoop(build, send=send)
    engine = loop.start()
    try:
        sink = Sink()
        loop.submit(engine.make_request("r", "hello", SamplingParams(max_tokens=4, ignore_eos=True)), sink)
        assert sink.done.wait(30)
        assert built_on[0] != threading.get_ident() and stepped_on == {built_on[0]}
    finally:
        loop.stop()


def test_a_failed_build_is_raised_by_start():
    def build():
        raise RuntimeError("no weights here")

    loop = EngineLoop(build, send=send)
    with pytest.raises(RuntimeError, match="no weights here"):
        loop.start()
    assert not loop.is_running()
    loop.stop()  # (what a model's finalize does) fine after a failed start


def test_each_steps_responses_are_sent_before_the_next_step(monkeypatch):
    # (The tiny engine's steps take a millisecond or two: the wait's bound relative to the step is lifted.)
    monkeypatch.setattr(engine_thread, "SEND_WAIT_FRACTION", 1000.0)
    events = []
    engine = tiny_engine()
    real_step = engine.step
    engine.step = lambda: events.append(("step",)) or real_step()

    def recording_send(sink, output):
        time.sleep(0.002)  # a send that takes a while: the next step must still wait for it
        events.append(("sent", output.step))
        send(sink, output)

    loop = EngineLoop(lambda: engine, send=recording_send)
    loop.start()
    try:
        sink = Sink()
        loop.submit(engine.make_request("r", "hello", SamplingParams(max_tokens=6, ignore_eos=True)), sink)
        assert sink.done.wait(30)
    finally:
        loop.stop()
    steps = [i for i, e in enumerate(events) if e == ("step",)]
    sent = [i for i, e in enumerate(events) if e[0] == "sent"]
    assert len(sent) == 6 and len(steps) >= 6
    # The k-th response was sent before the (k+1)-th step began (the prompt is one step, then one token a step).
    assert all(sent[k] < steps[k + 1] for k in range(5))


def test_the_engine_thread_sends_a_steps_responses_itself_while_the_sender_is_idle(monkeypatch):
    # (Two thread wake-ups a step saved; the tiny engine's steps are short, so the wait's bound is lifted.)
    monkeypatch.setattr(engine_thread, "SEND_WAIT_FRACTION", 1000.0)
    engine = tiny_engine()
    sent_on = []

    def recording_send(sink, output):
        sent_on.append(threading.current_thread().name)
        send(sink, output)

    loop = EngineLoop(lambda: engine, send=recording_send)
    loop.start()
    try:
        sinks = [Sink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            sampling = SamplingParams(max_tokens=8, n=1 + i, ignore_eos=True)
            loop.submit(engine.make_request(f"r{i}", "hello", sampling), sink)
        assert all(sink.done.wait(30) for sink in sinks)
        for i, sink in enumerate(sinks):
            check_stream_invariants(sink.outputs, {f"r{i}": 1 + i})
    finally:
        loop.stop()
    assert len(sent_on) == 8 * (1 + 2 + 3) and set(sent_on) == {"engine-loop"}


def test_sends_slower_than_the_wait_go_to_the_sender_and_generation_runs_ahead(monkeypatch):
    # A step waits for its sends a quarter of the step at most; sends that take longer must not set the
    # pace of generation: after the first, the sender takes them and joins the steps that queue up.
    monkeypatch.setattr(engine_thread, "SEND_WAIT_S", 0.01)
    engine = tiny_engine()
    sent_on, sent_when_generation_ended = [], []
    real_step = engine.step

    def step():
        outputs = real_step()
        if not engine.has_work():
            sent_when_generation_ended.append(len(sent_on))
        return outputs

    engine.step = step

    def slow_send(sink, output):
        time.sleep(0.2)  # far longer than a tiny-model step, even on a busy machine
        sent_on.append(threading.current_thread().name)
        send(sink, output)

    loop = EngineLoop(lambda: engine, send=slow_send)
    loop.start()
    try:
        sink = Sink()
        loop.submit(engine.make_request("r", "hello", SamplingParams(max_tokens=20, ignore_eos=True)), sink)
        assert sink.done.wait(30)
    finally:
        loop.stop()
    check_stream_invariants(sink.outputs, {"r": 1})
    assert sum(o.num_steps for o in sink.outputs) == 20
    assert sent_when_generation_ended[0] <= 3  # 20 steps ran while 3 responses at most went out
    assert len(sent_on) < 20 and sent_on.count("engine-loop") <= 1


def test_refused_requests_are_counted_as_sent_so_later_steps_do_not_wait(monkeypatch):
    # Every output, refusals included, goes through the count the next step waits on: a refusal that
    # skipped it left the count below zero, and every later step then waited the whole bound.
    monkeypatch.setattr(engine_thread, "SEND_WAIT_FRACTION", 1000.0)
    monkeypatch.setattr(engine_thread, "SEND_WAIT_S", 0.5)
    engine = tiny_engine()
    loop = EngineLoop(lambda: engine, send=send)
    loop.start()
    try:
        refused = Sink()
        loop.submit(engine.make_request("dup", "a", SamplingParams(max_tokens=40, ignore_eos=True)), Sink())
        loop.submit(engine.make_request("dup", "b", SamplingParams(max_tokens=2)), refused)
        assert refused.done.wait(30) and isinstance(refused.outputs[-1], RequestFailure)
        sink = Sink()
        start = time.monotonic()
        loop.submit(engine.make_request("r", "hello", SamplingParams(max_tokens=10, ignore_eos=True)), sink)
        assert sink.done.wait(30)
        assert time.monotonic() - start < 3  # 10+ steps that each waited 0.5 s would take 5 s or more
        assert loop._sender.unsent == 0
    finally:
        loop.stop()


@pytest.mark.parametrize("shutdown", [False, True])
def test_no_sink_is_asked_about_cancellation_once_its_last_response_went_out(monkeypatch, shutdown):
    # Triton frees a request's response factory once its final response is sent; asking is_cancelled() of
    # it afterwards crashed tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled). Many short
    # requests, slow questions asked as often as possible: the watcher and the sender race on every one.
    from backend.stand_in_engine import StandInEngine

    monkeypatch.setattr(cancel_watcher, "CANCEL_POLL_S", 0.0005)
    monkeypatch.setattr(cancel_watcher, "CANCEL_CHECKS_PER_POLL", 1000)
    closed: set[int] = set()
    late: list[int] = []
    asked = 0
    closed_lock = threading.Lock()

    def send_and_close(sink: Sink, output) -> None:
        with closed_lock:
            if isinstance(output, RequestFailure) or output.request_finished:
                closed.add(id(sink))
        send(sink, output)

    def is_cancelled(sink: Sink) -> bool:
        nonlocal asked
        asked += 1
        time.sleep(0.0002)  # a round trip to tritonserver
        with closed_lock:
            if id(sink) in closed:
                late.append(id(sink))
        return False

    engine = StandInEngine(step_ms=1.0, max_num_seqs=64)
    loop = EngineLoop(lambda: engine, send=send_and_close, is_cancelled=is_cancelled)
    loop.start()
    sinks = [Sink() for _ in range(300)]
    try:
        for i, sink in enumerate(sinks):
            loop.submit(engine.make_request(f"r{i}", "a b", SamplingParams(max_tokens=1 + i % 20)), sink)
        if shutdown:
            time.sleep(0.05)  # the model is unloaded while requests run: each ends with a failure
        else:
            assert all(sink.done.wait(30) for sink in sinks)
    finally:
        loop.stop()
    assert all(sink.done.is_set() for sink in sinks)
    assert asked > 0 and late == []


def test_the_step_trace_records_when_each_request_was_submitted_and_admitted(tmp_path):
    # benchmarks read these rows to see how a burst of requests reaches the engine (docs/performance.md)
    engine = tiny_engine()
    trace = StepTrace(str(tmp_path / "trace.tsv"))
    loop = EngineLoop(lambda: engine, send=send, trace=trace)
    loop.start()
    try:
        sinks = [Sink() for _ in range(3)]
        for i, sink in enumerate(sinks):
            loop.submit(engine.make_request(f"t{i}", "hello", SamplingParams(max_tokens=2, ignore_eos=True)), sink)
        assert all(sink.done.wait(30) for sink in sinks)
    finally:
        loop.stop()
    trace.flush()
    rows = [line.split("\t") for line in (tmp_path / "trace.tsv").read_text().splitlines()]
    for i in range(3):
        (submitted,) = [float(r[1]) for r in rows if r[0] == "submit" and r[3] == f"t{i}"]
        (admitted,) = [float(r[1]) for r in rows if r[0] == "admit" and r[3] == f"t{i}"]
        assert submitted <= admitted
    assert any(r[0] == "step" for r in rows) and any(r[0] == "send" for r in rows)
