"""Runs an engine on its own thread; its outputs go out between steps, the rest on a sender thread.

The engine thread steps the engine and sends the step's (already frozen) outputs itself while the
sender thread has nothing to send and the sends fit the wait below: the next step waits for them
anyway, and handing them over would cost two thread wake-ups a step. What does not fit (sends slower
than the wait, more outputs than fit in it) it puts on a queue, which the sender thread empties; the
engine steps on. Nothing mutable is shared between the two threads: a StepOutput is frozen and the
sink objects are only passed along.
A client that goes away can say so (`cancel`, by the key it submitted the request under: the frontend
sends such a message when its HTTP client disconnects); the request is aborted before the next step.
For clients that only close their stream, a third thread asks the running requests' sinks whether their
client went away (each question is a round trip to tritonserver, which on the engine thread would hold
up the next step) and hands the engine thread the ids to abort. The requests of a client that said it
sends cancel messages are asked only now and then, for a client that died before it could send one:
the questions take the cores the steps use.

Responses go out between steps: the next step starts once the last one's are sent (up to a quarter
of a step, SEND_WAIT_FRACTION). Sending needs the GIL and a core; taken during a step,
it stalls the step's OpenMP threads, which wait for each other at every parallel region.

With `stream_interval` N > 1 (config.pbtxt) each sequence's messages are held until N are pending (its
first and last go at once), and sent as one response (backend/coalescing.StreamInterval).

A sender that fell behind (more than one step queued) joins each sequence's pending steps into one
response (backend/coalescing.py), so it catches up without losing or reordering anything. It sends one
request's responses at a time and takes in what was queued meanwhile before the next: a request that
has ended goes out before those that go on, however far behind the sender is.

The engine is also *built* on the engine thread, so one thread runs all of its torch work. OpenMP
(libgomp, which torch and the C++ kernels share) gives every thread that starts parallel regions a
team of its own; once it manages more threads than there are cores it stops spinning between regions
and every region waits for sleeping workers to wake. Model loading on one thread and stepping on
another made two teams, which on 2 cores slowed each decode step by a half (docs/benchmarking.md).

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
from typing import TYPE_CHECKING, Generic, TypeVar

from backend.coalescing import PendingResponses, StreamInterval
from protocol import (
    AdmissionGroup,
    EngineOutput,
    GenerateRequest,
    InvalidRequestError,
    RequestFailure,
    StepOutput,
)

if TYPE_CHECKING:  # (no torch at import: model.py places the engine's threads before torch loads)
    from backend.engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

STATS_INTERVAL_S = 0.5
IDLE_WAIT_S = 0.05
# The longest the next step waits for the last step's responses to be sent: SEND_WAIT_S, and no more
# than SEND_WAIT_FRACTION of the step just run. On a CPU, where sending competes with the step for the
# cores, a step's sends take a small part of it and are waited for; where sending is the bottleneck (a
# large GPU batch, a stalled client) the engine goes on and the sender joins the steps that queue up.
SEND_WAIT_S = 0.05
SEND_WAIT_FRACTION = 0.25
# The weight of the latest send in the running estimate of what a send takes (an exponential average).
SEND_TIME_WEIGHT = 0.2
# How often running requests are asked whether their client went away, and how many at most each time
# (each question is a round trip to tritonserver, on the cancel-watcher thread). Beyond
# CANCEL_CHECKS_PER_POLL running requests they are asked in turn, so a cancelled one is noticed within
# CANCEL_POLL_S * ceil(running / CANCEL_CHECKS_PER_POLL), unless its client sent a cancel message.
CANCEL_POLL_S = 0.05
CANCEL_CHECKS_PER_POLL = 32
# How often the requests of a client that sends cancel messages are asked all the same (`submit`'s
# sends_cancel_message): a client that died mid-stream sends no message, but Triton cancels its calls.
CANCEL_BACKSTOP_S = 1.0


class StepTrace:
    """Timestamps of each step and each send (time.perf_counter: CLOCK_MONOTONIC, comparable across
    processes), for finding where served time goes (benchmarks/serve_profile.py). Rows are kept in
    memory and appended to `path` as TSV when the engine goes idle, between steps:
    `step <start> <end> <outputs>` and `send <start> <end> <outputs it covered>` (in step order);
    `submit <time> <time> <request id>` (execute() handed the request over) and `admit <time> <time>
    <request id>` (the engine thread took it in)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._rows: list[str] = []
        self._lock = threading.Lock()  # the engine and sender threads both add rows

    def add(self, kind: str, start: float, end: float, extra: str = "") -> None:
        with self._lock:
            self._rows.append(f"{kind}\t{start:.6f}\t{end:.6f}\t{extra}\n")

    def mark(self, kind: str, extra: str) -> None:
        """A row for one instant (start and end the same): now."""
        now = time.perf_counter()
        self.add(kind, now, now, extra)

    def flush(self) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
        if rows:
            with open(self.path, "a") as f:
                f.writelines(rows)


class EngineLoop(Generic[Sink]):
    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        send: Callable[[Sink, EngineOutput], None],
        is_cancelled: Callable[[Sink], bool] = lambda sink: False,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
        trace: StepTrace | None = None,
        stream_interval: int = 1,
    ) -> None:
        self._build_engine = build_engine
        self.engine: LLMEngine | None = None  # set on the engine thread by start()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._trace = trace
        self._send = send
        self._is_cancelled = is_cancelled
        self._on_stats = on_stats
        self._incoming: queue.Queue[tuple[GenerateRequest, Sink, str | None, bool, AdmissionGroup | None]] = (
            queue.Queue()
        )
        # Lists of (sink, output): one per step (one lock round per step, not per output); None stops.
        self._outgoing: queue.Queue[list[tuple[Sink, EngineOutput]] | None] = queue.Queue()
        self._held: StreamInterval[Sink] = StreamInterval(stream_interval)  # engine thread only
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._keys: dict[str, str] = {}  # request id -> the key it was submitted under (engine thread only)
        self._cancel_keys: queue.SimpleQueue[str] = queue.SimpleQueue()  # keys whose requests to abort
        # The running requests' sinks as the cancel watcher sees them, each with whether its client sends
        # cancel messages (the engine thread adds and removes), and the ids it found cancelled (the engine
        # thread aborts them).
        self._watched: dict[str, tuple[Sink, bool]] = {}
        self._watched_lock = threading.Condition()
        # The sink the cancel watcher is asking about now. Triton frees a request's response factory once
        # its last response is sent, and asking about it after that crashed tritonserver (SIGSEGV in
        # TRITONBACKEND_ResponseFactoryIsCancelled): a request leaves _watched before its last response is
        # queued, and that response is sent only once no question about its sink is under way.
        self._asking: Sink | None = None
        self._cancelled: queue.SimpleQueue[tuple[str, Sink]] = queue.SimpleQueue()
        self._cancel_turn: list[str] = []  # ids still to be asked in this round (cancel-watcher thread)
        self._next_backstop = 0.0  # when a round next asks those sending cancel messages too (cancel-watcher thread)
        self._unsent = 0  # outputs routed and not yet sent
        self._send_s = 0.0  # what a response takes to send, lately (either thread updates it)
        self._sent = threading.Condition()
        self._stopping = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_main, name="engine-loop", daemon=True)
        self._sender_thread = threading.Thread(target=self._sender_main, name="response-sender", daemon=True)
        self._watcher_thread = threading.Thread(target=self._watcher_main, name="cancel-watcher", daemon=True)

    def start(self) -> LLMEngine:
        """Builds the engine on the engine thread and starts stepping it; returns the engine (for
        make_request and stats, which other threads may call) or raises what building it raised."""
        self._engine_thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        self._sender_thread.start()
        self._watcher_thread.start()
        return self.engine

    def is_running(self) -> bool:
        """Every thread is alive and no stop was asked: what a health probe reports."""
        threads = (self._engine_thread, self._sender_thread, self._watcher_thread)
        return not self._stopping.is_set() and all(t.is_alive() for t in threads)

    def submit(
        self,
        request: GenerateRequest,
        sink: Sink,
        key: str | None = None,
        sends_cancel_message: bool = False,
        admission_group: AdmissionGroup | None = None,
    ) -> None:
        """Thread-safe: called from Triton's execute(). `key` (the client's id for the request) is what
        `cancel` names it by. `sends_cancel_message`: the client cancels a keyed request by message, so
        whether its client went away is asked only every CANCEL_BACKSTOP_S. `admission_group`: the
        other requests of the same client request (LLMEngine.add_request)."""
        if self._trace is not None:
            self._trace.mark("submit", request.request_id)
        self._incoming.put((request, sink, key, sends_cancel_message and key is not None, admission_group))

    def cancel(self, key: str) -> None:
        """Thread-safe: aborts the unfinished requests submitted under `key` (before the next step; each
        ends with its sequences' last, aborted, outputs). A key that names none is ignored."""
        self._cancel_keys.put(key)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._engine_thread.ident is not None:
            self._engine_thread.join(timeout)
        self._outgoing.put(None)
        for thread in (self._sender_thread, self._watcher_thread):
            if thread.ident is not None:  # (not started when building the engine failed)
                thread.join(timeout)

    # -- engine thread ------------------------------------------------------------------------

    def _engine_main(self) -> None:
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
                    start = time.perf_counter()
                    outputs = self.engine.step()
                    took = time.perf_counter() - start
                    if self._trace is not None:
                        self._trace.add("step", start, start + took, str(len(outputs)))
                    routed = [pair for output in outputs if (pair := self._route(output)) is not None]
                    self._send_step(self._held.release(routed), min(SEND_WAIT_S, SEND_WAIT_FRACTION * took))
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
        # Whatever is still running when the model is unloaded ends with an error, not silence (and is
        # asked about cancellation no more: that error is its last response).
        with self._watched_lock:
            self._watched.clear()
        self._enqueue(self._held.release_all())
        self._enqueue(
            [
                (sink, RequestFailure(request_id, "the model is shutting down"))
                for request_id, sink in self._sinks.items()
            ]
        )
        self._sinks.clear()
        self._keys.clear()

    def _admit(self, block: bool) -> None:
        try:
            item = self._incoming.get(timeout=IDLE_WAIT_S) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            request, sink, key, by_message, group = item
            if self._trace is not None:
                self._trace.mark("admit", request.request_id)
            try:
                self.engine.add_request(request, group)
                self._sinks[request.request_id] = sink
                if key is not None:
                    self._keys[request.request_id] = key
                with self._watched_lock:
                    self._watched[request.request_id] = (sink, by_message)
            except InvalidRequestError as e:
                self._enqueue([(sink, RequestFailure.refused(request.request_id, e))])
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
            for request_id in [rid for rid, k in self._keys.items() if k == key]:
                self.engine.abort_request(request_id)
        while True:
            try:
                request_id, sink = self._cancelled.get_nowait()
            except queue.Empty:
                return
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
            with self._watched_lock:
                self._watched.pop(output.request_id, None)
        return sink, output

    def _enqueue(self, outputs: list[tuple[Sink, EngineOutput]]) -> None:
        """Every output goes to the sender through here: the count the next step waits on."""
        if not outputs:
            return
        with self._sent:
            self._unsent += len(outputs)
        self._outgoing.put(outputs)

    def _send_step(self, outputs: list[tuple[Sink, EngineOutput]], budget: float) -> None:
        """A step's responses go out before the next step starts, for up to `budget` seconds. While the
        sender has nothing unsent, the engine thread sends them itself (handing them to the sender and
        being told they are sent would cost two thread wake-ups per step), one request at a time as the
        sender would; what the budget leaves it hands to the sender."""
        deadline = time.perf_counter() + budget
        with self._sent:
            sender_idle = self._unsent == 0  # and it stays so: only this thread adds to it
        if sender_idle and outputs:
            pending: PendingResponses[Sink] = PendingResponses()
            for sink, output in outputs:
                pending.add(sink, output)
            # (Sends slower than the budget, as from a stalled tritonserver, all go to the sender.)
            while pending and time.perf_counter() + self._send_s < deadline:
                for sink, message, _ in pending.take():
                    self._send_one(sink, message)
            outputs = []
            while pending:
                outputs.extend((sink, message) for sink, message, _ in pending.take())
        self._enqueue(outputs)
        self._wait_until_sent(deadline - time.perf_counter())

    def _wait_until_sent(self, timeout: float) -> None:
        """The next step starts once this step's responses are sent (or `timeout` passed): sending
        needs the GIL and a core, and taken during a step it stalls the step's OpenMP threads."""
        if timeout > 0:
            with self._sent:
                self._sent.wait_for(lambda: self._unsent == 0, timeout)

    # -- sender thread ------------------------------------------------------------------------

    def _sender_main(self) -> None:
        pending: PendingResponses[Sink] = PendingResponses()
        stopping = False
        while not (stopping and not pending):
            # Everything queued by now joins what is pending; wait only when nothing is.
            while not stopping:
                try:
                    batch = self._outgoing.get_nowait() if pending else self._outgoing.get()
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
        """One response, on the sender thread or (while the sender is idle) the engine thread."""
        if isinstance(output, RequestFailure) or output.request_finished:
            with self._watched_lock:  # (see _asking)
                self._watched_lock.wait_for(lambda: self._asking is not sink)
        start = time.perf_counter()
        try:
            self._send(sink, output)
            if self._trace is not None:  # (how many engine messages it covers)
                self._trace.add("send", start, time.perf_counter(), str(getattr(output, "num_steps", 1)))
        except Exception:  # a client that went away must not stop the others
            logger.exception("sending a response for %s failed", output.request_id)
        finally:
            self._send_s += SEND_TIME_WEIGHT * (time.perf_counter() - start - self._send_s)

    # -- cancel-watcher thread ----------------------------------------------------------------

    def _watcher_main(self) -> None:
        while not self._stopping.wait(CANCEL_POLL_S):
            try:
                self._poll_cancellation()
            except Exception:  # one failed question must not end the watching
                logger.exception("asking whether requests were cancelled failed")

    def _poll_cancellation(self) -> None:
        """Asks the next CANCEL_CHECKS_PER_POLL running requests whether their client went away (those
        whose client sends cancel messages only in a round that starts CANCEL_BACKSTOP_S after the last
        that asked them)."""
        if not self._cancel_turn:
            now = time.monotonic()
            backstop = now >= self._next_backstop
            if backstop:
                self._next_backstop = now + CANCEL_BACKSTOP_S
            with self._watched_lock:
                self._cancel_turn = [rid for rid, (_, by_msg) in self._watched.items() if backstop or not by_msg]
        asked = self._cancel_turn[:CANCEL_CHECKS_PER_POLL]
        del self._cancel_turn[:CANCEL_CHECKS_PER_POLL]
        for request_id in asked:
            with self._watched_lock:
                watched = self._watched.get(request_id)  # (it may have ended since the round began)
                if watched is None:
                    continue
                sink = watched[0]
                self._asking = sink  # its last response waits for the answer (_send_request)
            try:
                cancelled = self._is_cancelled(sink)
            finally:
                with self._watched_lock:
                    self._asking = None
                    self._watched_lock.notify_all()
            if cancelled:
                with self._watched_lock:
                    self._watched.pop(request_id, None)  # asked no more
                self._cancelled.put((request_id, sink))
