"""An engine on its own thread, its responses sent and its clients watched on two more (as vLLM's
EngineCoreProc, in one process): each thread is an object that owns its state.

- EngineThread (backend/engine_thread.py) builds and steps the engine: admits, aborts, routes outputs,
  publishes stats, and sends a step's responses itself while the sender is idle and they fit the wait.
- ResponseSender (backend/response_sender.py) sends the rest, joining a sequence's pending steps when behind.
- CancelWatcher (backend/cancel_watcher.py) asks the sinks in turn whether their client went away.
- InputStage (backend/input_stage.py) makes requests (tokenizes, validates) on worker threads of its own,
  so the thread that hands them in never waits for one.

What the threads share, and why: Triton's execute thread hands requests (through the input stage)
and cancel keys to the engine thread through queues, so it never waits for a step or for a request's
making; the engine thread hands the sender frozen outputs through a queue, and the count of those not
yet sent (ResponseSender) is what the next step waits on; the running requests' sinks are in one
WatchedSinks, which the engine, sender and watcher threads use, because a sink must not be asked
about once its last response is sent. Sinks are only passed along, to `send` and
`is_cancelled`. Why responses go out between steps, and what each choice measured: docs/performance.md.

Knows nothing about Triton: the adapter (triton_backend/adapter.py) gives it three callables (send an
output to a sink, ask whether a sink's client went away, publish stats), so it is tested without a server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from backend.cancel_watcher import CancelWatcher, WatchedSinks
from backend.engine_thread import EngineThread, Submission
from backend.input_stage import InputStage
from backend.response_sender import ResponseSender
from backend.step_trace import StepTrace
from protocol import AdmissionGroup, EngineOutput, GenerateRequest

if TYPE_CHECKING:  # (no torch at import: the adapter places the engine's threads before torch loads)
    from backend.engine import EngineStats, LLMEngine

__all__ = ["EngineLoop", "StepTrace"]

Sink = TypeVar("Sink")


class EngineLoop(Generic[Sink]):
    """Starts, feeds and stops the three threads: what the Triton adapter calls. `stream_interval` N > 1
    holds each sequence's messages until N are pending (its first and last go at once) and sends them as
    one response (backend/coalescing.StreamInterval)."""

    def __init__(
        self,
        build_engine: Callable[[], LLMEngine],
        send: Callable[[Sink, EngineOutput], None],
        is_cancelled: Callable[[Sink], bool] = lambda sink: False,
        on_stats: Callable[[EngineStats], None] = lambda stats: None,
        trace: StepTrace | None = None,
        stream_interval: int = 1,
    ) -> None:
        watched: WatchedSinks[Sink] = WatchedSinks()
        self._sender: ResponseSender[Sink] = ResponseSender(send, watched, trace)
        self._watcher: CancelWatcher[Sink] = CancelWatcher(is_cancelled, watched)
        self._engine_thread: EngineThread[Sink] = EngineThread(
            build_engine, self._sender, watched, on_stats, trace, stream_interval
        )
        self._input: InputStage[Sink] = InputStage(self._engine_thread.cancel, send)
        self._stopped = False

    @property
    def engine(self) -> LLMEngine | None:
        """The engine, once start() built it."""
        return self._engine_thread.engine

    def start(self) -> LLMEngine:
        """Builds the engine on the engine thread and starts stepping it; returns the engine (whose
        make_request Triton's execute thread calls) or raises what building it raised."""
        engine = self._engine_thread.start()
        self._sender.start()
        self._watcher.start()
        return engine

    def is_running(self) -> bool:
        """Every thread is alive and no stop was asked: what a health probe reports."""
        threads = (self._engine_thread, self._sender, self._watcher)
        return not self._stopped and all(t.is_alive() for t in threads)

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
        by_message = sends_cancel_message and key is not None
        self._engine_thread.submit(Submission(request, sink, key, by_message, admission_group))

    def make_and_submit(
        self,
        request_id: str,
        make: Callable[[], GenerateRequest],
        sink: Sink,
        key: str | None = None,
        sends_cancel_message: bool = False,
        admission_group: AdmissionGroup | None = None,
    ) -> None:
        """Thread-safe, and returns at once: `make()` (e.g. the engine's make_request) runs on the input
        stage's workers, and the request it makes is submitted as `submit` does; one it refuses gets its
        failure sent to `sink`."""
        self._input.make_and_submit(
            request_id,
            make,
            lambda request: self.submit(request, sink, key, sends_cancel_message, admission_group),
            sink,
            key,
        )

    def cancel(self, key: str) -> None:
        """Thread-safe: aborts the unfinished requests submitted under `key` (before the next step; each
        ends with its sequences' last, aborted, outputs), also those still being made. A key that names
        none is ignored."""
        self._input.cancel(key)

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the threads; whatever still runs gets a failure as its last response."""
        self._stopped = True
        self._input.stop()
        self._watcher.stop()
        self._engine_thread.stop()
        self._engine_thread.join(timeout)
        self._sender.close()
        self._sender.join(timeout)
        self._watcher.join(timeout)
