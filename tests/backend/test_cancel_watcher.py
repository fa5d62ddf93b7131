"""WatchedSinks and the cancel watcher on their own, without an engine (sinks are plain objects)."""

from __future__ import annotations

import threading

from backend.cancel_watcher import CancelWatcher, WatchedSinks


def test_a_last_response_waits_while_its_sink_is_being_asked_and_only_then():
    # Asking a sink whose last response went out crashed tritonserver: the sender waits for the answer.
    watched: WatchedSinks[str] = WatchedSinks()
    watched.watch("r", "sink-r", False)
    asking, answer = threading.Event(), threading.Event()

    def is_cancelled(sink: str) -> bool:
        asking.set()
        assert answer.wait(5)
        return False

    question = threading.Thread(target=watched.ask, args=("r", is_cancelled))
    question.start()
    assert asking.wait(5)
    may_send = threading.Event()
    sender = threading.Thread(target=lambda: (watched.wait_until_not_asked("sink-r"), may_send.set()))
    sender.start()
    assert not may_send.wait(0.05)  # its sink is being asked: the last response waits
    watched.wait_until_not_asked("another sink")  # another sink's does not
    answer.set()
    assert may_send.wait(5)
    question.join(5)
    sender.join(5)


def test_a_cancelled_request_goes_to_the_engine_thread_once_and_is_asked_no_more():
    watched: WatchedSinks[str] = WatchedSinks()
    watched.watch("a", "sink-a", False)
    watched.watch("b", "sink-b", True)  # its client sends cancel messages: asked in backstop rounds only
    assert watched.ids_to_ask(backstop=False) == ["a"]
    assert watched.ids_to_ask(backstop=True) == ["a", "b"]
    asked: list[str] = []

    def is_cancelled(sink: str) -> bool:
        asked.append(sink)
        return sink == "sink-a"

    watched.ask("a", is_cancelled)
    watched.ask("b", is_cancelled)
    assert watched.take_cancelled() == [("a", "sink-a")]
    assert watched.take_cancelled() == []
    watched.ask("a", is_cancelled)  # found cancelled: not asked again
    watched.forget("b")
    watched.ask("b", is_cancelled)  # forgotten (its last response is on its way): not asked
    assert asked == ["sink-a", "sink-b"]
    assert watched.ids_to_ask(backstop=True) == []


def test_each_poll_asks_the_next_few_in_turn_and_a_round_asks_each_once(monkeypatch):
    from backend import cancel_watcher

    monkeypatch.setattr(cancel_watcher, "CANCEL_CHECKS_PER_POLL", 2)
    watched: WatchedSinks[str] = WatchedSinks()
    for i in range(5):
        watched.watch(f"r{i}", f"s{i}", False)
    asked: list[str] = []
    watcher = CancelWatcher(lambda sink: asked.append(sink) or False, watched)
    per_poll = []
    for _ in range(3):
        before = len(asked)
        watcher.poll()
        per_poll.append(len(asked) - before)
    assert per_poll == [2, 2, 1] and asked == [f"s{i}" for i in range(5)]
    watcher.poll()  # a new round starts from the first again
    assert asked[5:] == ["s0", "s1"]
