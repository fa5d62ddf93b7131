"""The input stage (backend/input_stage.py): requests are made off the caller's thread, cancels are never lost."""

from __future__ import annotations

import threading
import time

from backend.engine_loop import EngineLoop
from backend.input_stage import InputStage
from protocol import GenerateRequest, InvalidRequestError, RequestFailure, SamplingParams, StepOutput
from tests.backend.test_engine_loop import Sink, send
from tests.engine_helpers import check_stream_invariants, tiny_engine


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, (1, 2, 3), SamplingParams(max_tokens=2), ())


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)

    def add(self, kind: str, what: str) -> None:
        with self.changed:
            self.events.append((kind, what))
            self.changed.notify_all()

    def wait_for(self, count: int, timeout: float = 10) -> list[tuple[str, str]]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.events) >= count, timeout), self.events
            return list(self.events)


def _stage(recorder: Recorder, **kwargs) -> InputStage:
    return InputStage(
        cancel=lambda key: recorder.add("cancel", key),
        send=lambda sink, failure: recorder.add("failed", f"{failure.request_id}: {failure.message}"),
        **kwargs,
    )


def _submit(recorder: Recorder):
    return lambda request: recorder.add("submit", request.request_id)


def test_a_slow_request_to_make_holds_neither_the_caller_nor_the_next_request():
    recorder, release = Recorder(), threading.Event()
    stage = _stage(recorder)

    def slow() -> GenerateRequest:
        release.wait(10)
        return _request("slow")

    start = time.monotonic()
    stage.make_and_submit("slow", slow, _submit(recorder), sink=None)
    stage.make_and_submit("quick", lambda: _request("quick"), _submit(recorder), sink=None)
    assert time.monotonic() - start < 1  # the caller only enqueued
    assert recorder.wait_for(1) == [("submit", "quick")]  # made on the other worker meanwhile
    assert stage.pending() == 1
    release.set()
    assert recorder.wait_for(2)[1] == ("submit", "slow")
    stage.stop()


def test_a_cancel_for_a_request_still_being_made_is_passed_on_after_its_submit():
    recorder, release = Recorder(), threading.Event()
    stage = _stage(recorder)

    def slow() -> GenerateRequest:
        release.wait(10)
        return _request("slow")

    stage.make_and_submit("slow", slow, _submit(recorder), sink=None, key="k1")
    stage.cancel("k1")  # held: its request is not submitted yet
    stage.cancel("other")  # no request of this key is being made: passed on at once
    assert recorder.wait_for(1) == [("cancel", "other")]
    release.set()
    assert recorder.wait_for(3) == [("cancel", "other"), ("submit", "slow"), ("cancel", "k1")]
    stage.cancel("k1")  # nothing held any more
    assert recorder.wait_for(4)[3] == ("cancel", "k1")
    stage.stop()


def test_refusals_while_making_are_sent_to_the_sink_and_the_workers_go_on():
    recorder = Recorder()
    stage = _stage(recorder)

    def invalid() -> GenerateRequest:
        raise InvalidRequestError("prompt must not be empty", "prompt")

    def broken() -> GenerateRequest:
        raise KeyError("oops")

    stage.make_and_submit("bad", invalid, _submit(recorder), sink=None)
    stage.make_and_submit("broken", broken, _submit(recorder), sink=None)
    stage.make_and_submit("good", lambda: _request("good"), _submit(recorder), sink=None)
    events = recorder.wait_for(3)
    assert ("failed", "bad: prompt must not be empty") in events
    assert ("failed", "broken: KeyError: 'oops'") in events
    assert ("submit", "good") in events
    stage.stop()


def test_past_max_pending_a_request_is_refused_as_overloaded_at_once():
    recorder, release = Recorder(), threading.Event()
    failures: list[RequestFailure] = []
    stage = InputStage(
        cancel=lambda key: None, send=lambda sink, failure: failures.append(failure), workers=1, max_pending=2
    )

    def slow() -> GenerateRequest:
        release.wait(10)
        return _request("slow")

    for i in range(3):
        stage.make_and_submit(f"r{i}", slow, _submit(recorder), sink=None)
    assert [(f.request_id, f.code) for f in failures] == [("r2", "overloaded")]
    release.set()
    recorder.wait_for(2)
    stage.stop()


def test_the_engine_loop_makes_requests_on_the_input_stage_and_cancels_them_while_made():
    engine = tiny_engine(num_kv_blocks=256)
    loop = EngineLoop(lambda: engine, send=send)
    loop.start()
    try:
        streamed, refused, cancelled = Sink(), Sink(), Sink()
        params = SamplingParams(n=2, max_tokens=6, ignore_eos=True)
        loop.make_and_submit("s", lambda: engine.make_request("s", "a prompt", params), streamed, "ks")
        loop.make_and_submit("e", lambda: engine.make_request("e", "", params), refused, "ke")
        release = threading.Event()

        def slow():
            release.wait(10)
            return engine.make_request("c", "x", SamplingParams(max_tokens=400, ignore_eos=True))

        loop.make_and_submit("c", slow, cancelled, "kc")
        loop.cancel("kc")
        release.set()
        for sink in (streamed, refused, cancelled):
            assert sink.done.wait(30)
        check_stream_invariants(streamed.outputs, {"s": 2})
        assert isinstance(refused.outputs[-1], RequestFailure) and refused.outputs[-1].param == "prompt"
        last = cancelled.outputs[-1]
        assert isinstance(last, StepOutput) and last.finish_reason.value == "abort"
    finally:
        loop.stop()


def test_requests_still_waiting_when_the_stage_stops_end_with_a_failure():
    recorder, release = Recorder(), threading.Event()
    stage = _stage(recorder, workers=1)

    def slow() -> GenerateRequest:
        release.wait(10)
        return _request("slow")

    stage.make_and_submit("slow", slow, _submit(recorder), sink=None)
    stage.make_and_submit("waiting", lambda: _request("waiting"), _submit(recorder), sink=None)
    stage.stop()
    release.set()
    assert sorted(recorder.wait_for(2)) == [("failed", "waiting: the model is shutting down"), ("submit", "slow")]
