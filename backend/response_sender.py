"""The response sender: sends the outputs the engine thread hands it, on its own thread.

A sender that fell behind (more than one step queued) joins each sequence's pending steps into one
response (backend/coalescing.PendingResponses), so it catches up without losing or reordering anything.
It sends one request's responses at a time and takes in what was queued meanwhile before the next: a
request that has ended goes out before those that go on, however far behind the sender is.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from backend.cancel_watcher import WatchedSinks
from backend.coalescing import PendingResponses
from backend.step_trace import StepTrace
from protocol import EngineOutput, RequestFailure

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

# The weight of the latest send in the running estimate of what a send takes (an exponential average).
SEND_TIME_WEIGHT = 0.2


class ResponseSender(Generic[Sink]):
    """Owns the queue of outputs to send and the count of those not yet sent, which the engine thread
    waits on before its next step. `send_step`, `hand_over` and `wait_until_sent` are the engine thread's
    calls; the queue is emptied on the "response-sender" thread."""

    def __init__(
        self, send: Callable[[Sink, EngineOutput], None], watched: WatchedSinks[Sink], trace: StepTrace | None
    ) -> None:
        self._send = send
        self._watched = watched
        self._trace = trace
        # Lists of (sink, output): one per step (one lock round per step, not per output); None stops.
        self._queue: queue.Queue[list[tuple[Sink, EngineOutput]] | None] = queue.Queue()
        self._unsent = 0  # outputs handed over and not yet sent
        self._sent = threading.Condition()
        # What a response takes to send, lately. Both threads update it, never at once: the engine thread
        # sends only while nothing handed over is unsent.
        self._send_s = 0.0
        self._thread = threading.Thread(target=self._run, name="response-sender", daemon=True)

    @property
    def unsent(self) -> int:
        with self._sent:
            return self._unsent

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        """The thread ends once what was handed over before is sent."""
        self._queue.put(None)

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # (not started when building the engine failed)
            self._thread.join(timeout)

    # -- the engine thread's calls ----------------------------------------------------------------

    def send_step(self, outputs: list[tuple[Sink, EngineOutput]], budget: float) -> None:
        """Sends a step's responses and returns once they are sent or `budget` seconds passed. While
        nothing is unsent, the calling thread sends them itself (handing them over and being told they
        are sent would cost two thread wake-ups per step), one request at a time as the sender thread
        would; what the budget leaves it hands over."""
        deadline = time.perf_counter() + budget
        if self.unsent == 0 and outputs:  # (and it stays so: only the engine thread hands over)
            pending: PendingResponses[Sink] = PendingResponses()
            for sink, output in outputs:
                pending.add(sink, output)
            # (Sends slower than the budget, as from a stalled tritonserver, all go to the sender thread.)
            while pending and time.perf_counter() + self._send_s < deadline:
                for sink, message, _ in pending.take():
                    self._send_one(sink, message)
            outputs = []
            while pending:
                outputs.extend((sink, message) for sink, message, _ in pending.take())
        self.hand_over(outputs)
        self.wait_until_sent(deadline - time.perf_counter())

    def hand_over(self, outputs: list[tuple[Sink, EngineOutput]]) -> None:
        """Every output reaches the sender thread through here: the count `wait_until_sent` waits on."""
        if not outputs:
            return
        with self._sent:
            self._unsent += len(outputs)
        self._queue.put(outputs)

    def wait_until_sent(self, timeout: float) -> None:
        if timeout > 0:
            with self._sent:
                self._sent.wait_for(lambda: self._unsent == 0, timeout)

    # -- the sender thread ----------------------------------------------------------------------

    def _run(self) -> None:
        pending: PendingResponses[Sink] = PendingResponses()
        stopping = False
        while not (stopping and not pending):
            # Everything queued by now joins what is pending; wait only when nothing is.
            while not stopping:
                try:
                    batch = self._queue.get_nowait() if pending else self._queue.get()
                except queue.Empty:
                    break
                if batch is None:
                    stopping = True  # (what came before it is still sent)
                    break
                for sink, output in batch:
                    pending.add(sink, output)
            if pending:
                self._send_request(pending.take())

    def _send_request(self, responses: list[tuple[Sink, EngineOutput, int]]) -> None:
        """One request's responses, each covering `covered` queued outputs."""
        for sink, output, covered in responses:
            try:
                self._send_one(sink, output)
            finally:
                with self._sent:
                    self._unsent -= covered
                    if self._unsent == 0:
                        self._sent.notify_all()

    def _send_one(self, sink: Sink, output: EngineOutput) -> None:
        if isinstance(output, RequestFailure) or output.request_finished:
            self._watched.wait_until_not_asked(sink)
        start = time.perf_counter()
        try:
            self._send(sink, output)
            if self._trace is not None:  # (how many engine messages it covers)
                self._trace.add("send", start, time.perf_counter(), str(getattr(output, "num_steps", 1)))
        except Exception:  # a client that went away must not stop the others
            logger.exception("sending a response for %s failed", output.request_id)
        finally:
            self._send_s += SEND_TIME_WEIGHT * (time.perf_counter() - start - self._send_s)
