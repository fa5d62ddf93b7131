"""The cancel watcher: asks the running requests' sinks, a few at a time, whether their client went away.

Each question is a round trip to tritonserver, which on the engine thread would hold up the next step;
the watcher asks on its own thread and the engine thread aborts what it found before its next step.
Requests whose client sends cancel messages (the frontend's) are asked only as a backstop, for a client
that died before it could send one: the questions take the cores the steps use.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

# How often running requests are asked, and how many at most each time: beyond CANCEL_CHECKS_PER_POLL
# they are asked in turn, so a cancelled one is noticed within
# CANCEL_POLL_S * ceil(running / CANCEL_CHECKS_PER_POLL), unless its client sent a cancel message.
CANCEL_POLL_S = 0.05
CANCEL_CHECKS_PER_POLL = 32
# How often the requests of a client that sends cancel messages are asked all the same: a client that
# died mid-stream sends no message, but Triton cancels its calls.
CANCEL_BACKSTOP_S = 1.0


class WatchedSinks(Generic[Sink]):
    """The running requests' sinks, the one the watcher is asking about now, and the ids it found cancelled.

    Triton frees a request's response factory once its last response is sent, and asking about it after
    that crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled). So the engine thread
    `forget`s a request before its last response is handed to a sender, and that response is sent only
    once `wait_until_not_asked` says no question about its sink is under way. Thread-safe.
    """

    def __init__(self) -> None:
        self._watched: dict[str, tuple[Sink, bool]] = {}  # request id -> (sink, its client sends cancel messages)
        self._asking: Sink | None = None
        self._lock = threading.Condition()
        self._found: queue.SimpleQueue[tuple[str, Sink]] = queue.SimpleQueue()

    def watch(self, request_id: str, sink: Sink, sends_cancel_message: bool) -> None:
        with self._lock:
            self._watched[request_id] = (sink, sends_cancel_message)

    def forget(self, request_id: str) -> None:
        """Asked about no more (before its last response is handed over)."""
        with self._lock:
            self._watched.pop(request_id, None)

    def forget_all(self) -> None:
        with self._lock:
            self._watched.clear()

    def ids_to_ask(self, backstop: bool) -> list[str]:
        """The running requests to ask in a round: those whose client sends cancel messages only in a
        `backstop` round."""
        with self._lock:
            return [rid for rid, (_, by_message) in self._watched.items() if backstop or not by_message]

    def ask(self, request_id: str, is_cancelled: Callable[[Sink], bool]) -> None:
        """Asks whether the client of `request_id` (if it still runs) went away; one that did is asked no
        more, and `take_cancelled` gives it to the engine thread."""
        with self._lock:
            watched = self._watched.get(request_id)  # (it may have ended since the round began)
            if watched is None:
                return
            sink = self._asking = watched[0]
        try:
            cancelled = is_cancelled(sink)
        finally:
            with self._lock:
                self._asking = None
                self._lock.notify_all()
        if cancelled:
            self.forget(request_id)
            self._found.put((request_id, sink))

    def wait_until_not_asked(self, sink: Sink) -> None:
        """Returns once no question about `sink` is under way: called before sending its last response."""
        with self._lock:
            self._lock.wait_for(lambda: self._asking is not sink)

    def take_cancelled(self) -> list[tuple[str, Sink]]:
        """The (request id, sink) pairs found cancelled since the last call."""
        found = []
        while True:
            try:
                found.append(self._found.get_nowait())
            except queue.Empty:
                return found


class CancelWatcher(Generic[Sink]):
    """The "cancel-watcher" thread: every CANCEL_POLL_S asks the next CANCEL_CHECKS_PER_POLL watched
    requests (a round asks every one once; a backstop round, every CANCEL_BACKSTOP_S, those whose client
    sends cancel messages too). Owns the round's order and timing."""

    def __init__(self, is_cancelled: Callable[[Sink], bool], watched: WatchedSinks[Sink]) -> None:
        self._is_cancelled = is_cancelled
        self._watched = watched
        self._turn: list[str] = []  # ids still to be asked in this round
        self._next_backstop = 0.0  # when a round next asks those sending cancel messages too
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cancel-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # (not started when building the engine failed)
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopping.wait(CANCEL_POLL_S):
            try:
                self.poll()
            except Exception:  # one failed question must not end the watching
                logger.exception("asking whether requests were cancelled failed")

    def poll(self) -> None:
        """Asks the next CANCEL_CHECKS_PER_POLL requests of the round (a new round when it is done)."""
        if not self._turn:
            now = time.monotonic()
            backstop = now >= self._next_backstop
            if backstop:
                self._next_backstop = now + CANCEL_BACKSTOP_S
            self._turn = self._watched.ids_to_ask(backstop)
        asked = self._turn[:CANCEL_CHECKS_PER_POLL]
        del self._turn[:CANCEL_CHECKS_PER_POLL]
        for request_id in asked:
            self._watched.ask(request_id, self._is_cancelled)
