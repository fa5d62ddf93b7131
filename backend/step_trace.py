"""Timestamps of each step and each send, for finding where served time goes (benchmarks/serve_profile.py)."""

from __future__ import annotations

import threading
import time


class StepTrace:
    """Rows kept in memory (time.perf_counter: CLOCK_MONOTONIC, comparable across processes) and appended
    to `path` as TSV when the engine goes idle, between steps: `step <start> <end> <outputs>` and
    `send <start> <end> <outputs it covered>` (in step order); `submit <time> <time> <request id>`
    (execute() handed the request over) and `admit <time> <time> <request id>` (the engine thread took
    it in). Thread-safe: the engine thread and the response sender both add rows."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._rows: list[str] = []
        self._lock = threading.Lock()

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
