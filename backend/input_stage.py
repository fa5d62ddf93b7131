"""The input stage: requests are made (tokenized, validated, their grammar parsed) on a few worker threads
of their own, so the thread that hands them in (Triton's execute) never waits for one.

Why: what Triton's execute thread does, a health probe waits behind. A request whose making takes
seconds (a huge prompt to tokenize, a big schema to parse) would hold every probe that long, and the
frontend would take a busy engine for a dead one. The work here releases the GIL (the tokenizer and
xgrammar are native code), so the execute thread answers probes while it runs.

A request stays here until it is made; a cancel naming its key meanwhile is held and passed on right
after the request is submitted, so it is never lost. At most `max_pending` requests wait here; past that
a request is refused as overloaded at once, as the engine's own queue does.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from protocol import EngineOutput, EngineOverloaded, GenerateRequest, InvalidRequestError, RequestFailure

logger = logging.getLogger(__name__)

Sink = TypeVar("Sink")

INPUT_WORKERS = 2  # one long request to make leaves the other for the rest
MAX_PENDING = 1024


class InputStage(Generic[Sink]):
    """Runs each request's `make()` on a worker, then hands what it made to that request's `submit`; a
    request refused while being made gets its failure through `send(sink, failure)`. `cancel(key)` is
    passed on once no request of that key is still being made. Thread-safe."""

    def __init__(
        self,
        cancel: Callable[[str], None],
        send: Callable[[Sink, EngineOutput], None],
        workers: int = INPUT_WORKERS,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._cancel, self._send = cancel, send
        self._max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="engine-input")
        self._lock = threading.Lock()
        self._pending = 0
        self._pending_keys: Counter[str] = Counter()  # key -> its requests still being made
        self._held_cancels: set[str] = set()
        self._stopped = False

    def make_and_submit(
        self,
        request_id: str,
        make: Callable[[], GenerateRequest],
        submit: Callable[[GenerateRequest], None],
        sink: Sink,
        key: str | None = None,
    ) -> None:
        with self._lock:
            full = self._pending >= self._max_pending
            if not full:
                self._pending += 1
                if key is not None:
                    self._pending_keys[key] += 1
            pending = self._pending
        if full:  # (sent outside the lock: a send may block on its client)
            refusal = EngineOverloaded(
                f"the server is overloaded: {pending} requests are being prepared; retry later", code="overloaded"
            )
            self._send(sink, RequestFailure.refused(request_id, refusal))
            return
        self._pool.submit(self._make, request_id, make, submit, sink, key)

    def cancel(self, key: str) -> None:
        with self._lock:
            if self._pending_keys.get(key, 0) > 0:
                self._held_cancels.add(key)
                return
        self._cancel(key)

    def pending(self) -> int:
        with self._lock:
            return self._pending

    def stop(self) -> None:
        """What is still waiting to be made ends with a failure (the workers send it), not silence."""
        self._stopped = True
        self._pool.shutdown(wait=False)

    def _make(
        self,
        request_id: str,
        make: Callable[[], GenerateRequest],
        submit: Callable[[GenerateRequest], None],
        sink: Sink,
        key: str | None,
    ) -> None:
        try:
            if self._stopped:
                self._send(sink, RequestFailure(request_id, "the model is shutting down"))
                return
            submit(make())
        except InvalidRequestError as e:
            self._send(sink, RequestFailure.refused(request_id, e))
        except Exception as e:  # a malformed request must not end the worker or go unanswered
            logger.exception("making request %s failed", request_id)
            self._send(sink, RequestFailure(request_id, f"{type(e).__name__}: {e}", "invalid_request_error"))
        finally:
            self._done(key)

    def _done(self, key: str | None) -> None:
        with self._lock:
            self._pending -= 1
            if key is None:
                return
            self._pending_keys[key] -= 1
            if self._pending_keys[key] > 0:
                return
            del self._pending_keys[key]
            if key not in self._held_cancels:
                return
            self._held_cancels.discard(key)
        self._cancel(key)  # after the submit: the engine thread admits what came before a cancel
