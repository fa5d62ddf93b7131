"""The engine thread: builds the engine and steps it, on one thread ("engine-loop").

The engine is built on the thread that steps it, so one thread runs all of its torch work: OpenMP
(libgomp, which torch and the C++ kernels share) gives each thread that starts parallel regions a team
of its own, and once it manages more threads than cores its workers sleep between regions.
Each step's responses go out before the next step starts (up to SEND_WAIT_FRACTION of the step, at most
SEND_WAIT_S): a send needs the GIL and a core, and taken during a step it stalls the step's OpenMP
threads, which wait for each other at every parallel region. Figures: docs/performance.md.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from backend.cancel_watcher import WatchedSinks
from backend.coalescing import StreamInterval
from backend.response_sender import ResponseSender
from backend.step_trace import StepTrace
from protocol import AdmissionGroup, EngineOutput, GenerateRequest, InvalidRequestError, RequestFailure, StepOutput

if TYPE_CHECKING:  # (no torch at import: the adapter places the engine's threads before torch loads)
    from backend.engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

STATS_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.05
# The longest the next step waits for the last step's responses: SEND_WAIT_S, and no more than
# SEND_WAIT_FRACTION of the step just run. On a CPU a step's sends take a small part of it and are
# waited for; where sending is the bottleneck (a large GPU batch, a stalled client) the engine goes on
# and the sender joins the steps that queue up.
SEND_WAIT_S = 0.05
SEND_WAIT_FRACTION = 0.25


@dataclass(frozen=True, slots=True)
class Submission(Generic[Sink]):
    """A request on its way from `submit` to the engine thread."""

    request: GenerateRequest
    sink: Sink
    key: str | None  # what `cancel` names it by
    sends_cancel_message: bool  # its client went away is asked only as a backstop
    admission_group: AdmissionGroup | None


class EngineThread(Generic[Sink]):
    """Admits what `submit` queued, aborts what `cancel` and the cancel watcher named, steps the engine,
    routes each step's outputs to their requests' sinks for the response sender, and publishes stats.
    `submit` and `cancel` are thread-safe; the rest is this thread's. On stop, whatever still runs ends
    with a failure."""

    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        responses: ResponseSender[Sink],
        watched: WatchedSinks[Sink],
        on_stats: Callable[[EngineStats], None],
        trace: StepTrace | None,
        stream_interval: int,
    ) -> None:
        self._build_engine = build_engine
        self._responses = responses
        self._watched = watched
        self._on_stats = on_stats
        self._trace = trace
        self.engine: LLMEngine | None = None  # set by start()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._incoming: queue.Queue[Submission[Sink]] = queue.Queue()
        self._cancel_keys: queue.SimpleQueue[str] = queue.SimpleQueue()  # keys whose requests to abort
        self._held: StreamInterval[Sink] = StreamInterval(stream_interval)
        self._sinks: dict[str, Sink] = {}  # request id -> its sink, until its last output is routed
        self._keys: dict[str, str] = {}  # request id -> the key it was submitted under
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> LLMEngine:
        """Builds the engine on this thread and starts stepping it; returns the engine or raises what
        building it raised."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, submission: Submission[Sink]) -> None:
        if self._trace is not None:
            self._trace.mark("submit", submission.request.request_id)
        self._incoming.put(submission)

    def cancel(self, key: str) -> None:
        self._cancel_keys.put(key)

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:
            self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = self._build_engine()
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._build_error = e
            return
        finally:
            self._built.set()
        last_stats = 0.0
        stats_current = False  # published since the engine last did any work
        while not self._stopping.is_set():
            try:
                self._admit(block=not self.engine.has_work())
                self._abort_cancelled()
                busy = self.engine.has_work()
                if busy:
                    self._step()
                    stats_current = False
                now = time.monotonic()
                # Every interval while busy, and once as soon as the engine is idle (so freed KV
                # blocks show at once), but not on every idle wake-up.
                idle_now = not self.engine.has_work()
                if (busy and now - last_stats >= STATS_INTERVAL_S) or (idle_now and not stats_current):
                    self._on_stats(self.engine.stats())
                    last_stats = now
                    stats_current = idle_now
                if idle_now and self._trace is not None:
                    self._trace.flush()
            except Exception:  # the loop must outlive any single failure
                logger.exception("engine loop iteration failed")
                time.sleep(IDLE_WAIT_S)
        self._fail_running()
        self.engine.close()

    def _step(self) -> None:
        start = time.perf_counter()
        outputs = self.engine.step()
        took = time.perf_counter() - start
        if self._trace is not None:
            self._trace.add("step", start, start + took, str(len(outputs)))
        routed = [pair for output in outputs if (pair := self._route(output)) is not None]
        self._responses.send_step(self._held.release(routed), min(SEND_WAIT_S, SEND_WAIT_FRACTION * took))

    def _fail_running(self) -> None:
        """Whatever is still running when the model is unloaded ends with an error, not silence (and is
        asked about cancellation no more: that error is its last response)."""
        self._watched.forget_all()
        self._responses.hand_over(self._held.release_all())
        shutting_down = [(sink, RequestFailure(rid, "the model is shutting down")) for rid, sink in self._sinks.items()]
        self._responses.hand_over(shutting_down)
        self._sinks.clear()
        self._keys.clear()

    def _admit(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=IDLE_WAIT_S) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            request, sink = item.request, item.sink
            if self._trace is not None:
                self._trace.mark("admit", request.request_id)
            try:
                self.engine.add_request(request, item.admission_group)
                self._sinks[request.request_id] = sink
                if item.key is not None:
                    self._keys[request.request_id] = item.key
                self._watched.watch(request.request_id, sink, item.sends_cancel_message)
            except InvalidRequestError as e:
                self._responses.hand_over([(sink, RequestFailure.refused(request.request_id, e))])
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _abort_cancelled(self) -> None:
        """Aborts the requests cancelled by key and those the cancel watcher found cancelled (the ones
        still running)."""
        while True:
            try:
                key = self._cancel_keys.get_nowait()
            except queue.Empty:
                break
            self._admit(block=False)  # what was submitted before the cancel (it may have come since _admit)
            for request_id in [rid for rid, k in self._keys.items() if k == key]:
                self.engine.abort_request(request_id)
        for request_id, sink in self._watched.take_cancelled():
            if self._sinks.get(request_id) is sink:  # (not a later request that reused the id)
                self.engine.abort_request(request_id)

    def _route(self, output: EngineOutput) -> tuple[Sink, EngineOutput] | None:
        """The output with its sink (None when its request is gone); forgets requests that end."""
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return None
        if isinstance(output, RequestFailure) or (isinstance(output, StepOutput) and output.request_finished):
            del self._sinks[output.request_id]
            self._keys.pop(output.request_id, None)
            self._watched.forget(output.request_id)
        return sink, output
