"""Runs an engine on its own thread and hands its outputs to a sender thread.

The engine thread never waits on the network: it only steps the engine and puts the (already
frozen) outputs on a queue; the sender thread takes them off and sends them. Nothing mutable is
shared between the two threads: a StepOutput is frozen and the sink objects are only passed along.

Knows nothing about Triton: the adapter in model_repository/ gives it three callables (send an
output to a sink, ask whether a sink's client went away, publish stats), so it is tested without
a server.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from backend.engine import EngineStats, LLMEngine
from backend.types import EngineOutput, GenerateRequest, InvalidRequestError, RequestFailure, StepOutput

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

STATS_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.05


class EngineLoop(Generic[Sink]):
    def __init__(
        self,
        engine: LLMEngine,
        send: Callable[[Sink, EngineOutput], None],
        is_cancelled: Callable[[Sink], bool] = lambda sink: False,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
    ) -> None:
        self.engine = engine
        self._send = send
        self._is_cancelled = is_cancelled
        self._on_stats = on_stats
        self._incoming: queue.Queue[tuple[GenerateRequest, Sink]] = queue.Queue()
        self._outgoing: queue.Queue[tuple[Sink, EngineOutput] | None] = queue.Queue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._stopping = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_main, name="engine-loop", daemon=True)
        self._sender_thread = threading.Thread(target=self._sender_main, name="response-sender", daemon=True)

    def start(self) -> None:
        self._engine_thread.start()
        self._sender_thread.start()

    def is_running(self) -> bool:
        """Both threads are alive and no stop was asked: what a health probe reports."""
        return not self._stopping.is_set() and self._engine_thread.is_alive() and self._sender_thread.is_alive()

    def submit(self, request: GenerateRequest, sink: Sink) -> None:
        """Thread-safe: called from Triton's execute()."""
        self._incoming.put((request, sink))

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._engine_thread.join(timeout)
        self._outgoing.put(None)
        self._sender_thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------

    def _engine_main(self) -> None:
        last_stats = 0.0
        stats_current = False  # published since the engine last did any work
        while not self._stopping.is_set():
            try:
                self._admit(block=not self.engine.has_work())
                self._abort_cancelled()
                busy = self.engine.has_work()
                if busy:
                    for output in self.engine.step():
                        self._route(output)
                    stats_current = False
                now = time.monotonic()
                # Every interval while busy, and once as soon as the engine is idle (so freed KV
                # blocks show at once), but not on every idle wake-up.
                idle_now = not self.engine.has_work()
                if (busy and now - last_stats >= STATS_INTERVAL_S) or (idle_now and not stats_current):
                    self._on_stats(self.engine.stats())
                    last_stats = now
                    stats_current = idle_now
            except Exception:  # noqa: BLE001 - the loop must outlive any single failure
                logger.exception("engine loop iteration failed")
                time.sleep(IDLE_WAIT_S)
        # Whatever is still running when the model is unloaded ends with an error, not silence.
        for request_id, sink in list(self._sinks.items()):
            self._outgoing.put((sink, RequestFailure(request_id, "the model is shutting down")))
        self._sinks.clear()

    def _admit(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=IDLE_WAIT_S) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            request, sink = item
            try:
                self.engine.add_request(request)
                self._sinks[request.request_id] = sink
            except InvalidRequestError as e:
                self._outgoing.put((sink, RequestFailure.refused(request.request_id, e)))
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _abort_cancelled(self) -> None:
        for request_id, sink in list(self._sinks.items()):
            if self._is_cancelled(sink):
                self.engine.abort_request(request_id)

    def _route(self, output: EngineOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if isinstance(output, RequestFailure) or (isinstance(output, StepOutput) and output.request_finished):
            del self._sinks[output.request_id]
        self._outgoing.put((sink, output))

    # -- sender thread ------------------------------------------------------------------------

    def _sender_main(self) -> None:
        while True:
            item = self._outgoing.get()
            if item is None:
                return
            sink, output = item
            try:
                self._send(sink, output)
            except Exception:  # noqa: BLE001 - a client that went away must not stop the others
                logger.exception("sending a response for %s failed", output.request_id)
