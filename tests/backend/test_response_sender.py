"""The response sender on its own, without an engine (sinks are lists)."""

from __future__ import annotations

import subprocess
import sys
import threading

from backend.cancel_watcher import WatchedSinks
from backend.response_sender import ResponseSender
from protocol import FinishReason, RequestFailure, StepOutput


def _step(request_id: str, step: int, last: bool = False) -> StepOutput:
    finish = FinishReason.LENGTH if last else None
    return StepOutput(request_id, 0, step, (7,), " x", None, finish, None, 1, step + 1, request_finished=last)


def _recording_sender():
    sent: list[tuple[str, object]] = []

    def send(sink: list, output) -> None:
        sent.append((threading.current_thread().name, output))
        sink.append(output)

    return ResponseSender(send, WatchedSinks(), None), sent


def test_a_step_is_sent_on_the_calling_thread_while_nothing_is_unsent():
    sender, sent = _recording_sender()
    sender.start()
    try:
        sink: list = []
        sender.send_step([(sink, _step("r", 0)), (sink, _step("r", 1, last=True))], budget=5.0)
        assert {name for name, _ in sent} == {threading.current_thread().name}
        assert len(sink) == 1 and sink[0].num_steps == 2 and sink[0].request_finished  # joined, as the sender would
        assert sender.unsent == 0
    finally:
        sender.close()
        sender.join(5)


def test_what_the_budget_leaves_goes_to_the_sender_thread_and_the_count_drains():
    sender, sent = _recording_sender()
    sender.start()
    try:
        sinks: list[list] = [[], []]
        sender.send_step([(sinks[0], _step("a", 0, last=True)), (sinks[1], RequestFailure("b", "gone"))], budget=0.0)
        sender.wait_until_sent(5)
        assert sender.unsent == 0
        assert {name for name, _ in sent} == {"response-sender"}
        assert sinks[0][-1].request_finished and sinks[1] == [RequestFailure("b", "gone")]
    finally:
        sender.close()
        sender.join(5)


def test_what_was_handed_over_before_close_is_still_sent():
    sender, sent = _recording_sender()
    sink: list = []
    sender.hand_over([(sink, _step("r", i)) for i in range(3)])
    sender.hand_over([(sink, _step("r", 3, last=True))])
    sender.close()
    sender.start()
    sender.join(5)
    assert not sender.is_alive() and sender.unsent == 0
    assert sum(o.num_steps for o in sink) == 4 and sink[-1].request_finished


def test_the_engine_loop_imports_no_torch():
    # The adapter places the engine's threads (backend/cpu_placement.py) before torch loads.
    code = "import sys, backend.engine_loop; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
