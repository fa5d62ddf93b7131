"""A process that compiles structured-outputs constraints on trial, so that a compile past its time budget
can be stopped: xgrammar has no cancel, but a process can be killed, and its thread, core and memory go with it.

The engine's compiler (backend/grammar_compiler.py) keeps a few of these warm, one per compile seat, and
sends each one constraint at a time (`GrammarWorker.trial`). The worker compiles it against the vocabulary
and answers with the compiled grammar's size, or the compile's error; past the budget the engine kills it
and starts another. A constraint that passed its trial is compiled once more in the engine's process, which
then takes about as long as the trial did: xgrammar's `CompiledGrammar.serialize_json` costs more than
compiling again (its JSON holds every rule's automaton, which grows with the square of a schema's optional
properties), so the grammar itself never crosses.

The worker is a child of the engine's process (Triton's python stub, with torch and threads: it is started
with a fresh interpreter, never forked) and never outlives it: a thread of its own reads the requests and
exits the process at end of file, which comes when the engine closes the pipe or dies, even SIGKILLed, even
mid-compile (xgrammar lets go of the GIL while it compiles).
"""

from __future__ import annotations

import ctypes
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from protocol import InvalidRequestError, StructuredOutputs

WORKER_MODULE = "backend.grammar_worker"
START_TIMEOUT_S = 120.0  # a worker not ready by then (a broken install) is given up; imports take seconds
OVER_MEMORY_EXIT_CODE = 86  # the worker's exit status when a trial went past its memory budget
MEMORY_POLL_S = 0.01  # how often a compiling worker reads its resident memory


@dataclass(frozen=True, slots=True)
class Trial:
    """Compile this constraint and say what it cost (engine -> worker)."""

    spec: StructuredOutputs


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What a trial found (worker -> engine): the compiled grammar's size, or why it did not compile."""

    size_bytes: int = 0
    seconds: float = 0.0
    error: str | None = None  # xgrammar's message: the constraint cannot be compiled
    refusal: InvalidRequestError | None = None  # the constraint did not parse (checked before; kept for safety)


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker has built its compiler (worker -> engine, once)."""

    pid: int


class WorkerGone(Exception):
    """The worker ended (killed past a budget, or crashed) before it answered."""


class GrammarWorker:
    """The engine's side of one worker process: one trial at a time, from one thread at a time; `kill`
    from any thread."""

    def __init__(self, process: subprocess.Popen[bytes], requests: Connection, results: Connection) -> None:
        self._process = process
        self._requests = requests
        self._results = results
        self.pid = process.pid

    @classmethod
    def start(
        cls, tokenizer_info_json: Callable[[], str], module: str = WORKER_MODULE, memory_budget_bytes: int = 0
    ) -> GrammarWorker:
        """A new worker, its compiler built for the vocabulary `tokenizer_info_json()` describes (xgrammar's
        TokenizerInfo.serialize_json, made while the worker imports); blocks until it is ready (seconds: it
        imports xgrammar and torch). A trial whose compile grows the worker's resident memory by more than
        `memory_budget_bytes` (0: unbounded) ends the worker (`over_memory` then says so)."""
        request_read, request_write = os.pipe()
        result_read, result_write = os.pipe()
        try:
            process = subprocess.Popen(
                [_python(), "-m", module, str(request_read), str(result_write), str(memory_budget_bytes)],
                stdin=subprocess.DEVNULL,
                pass_fds=(request_read, result_write),
                env=_worker_environment(),
            )
        except BaseException:
            for fd in (request_read, request_write, result_read, result_write):
                os.close(fd)
            raise
        os.close(request_read)  # the child's ends: with ours closed, the child's end of file is our close
        os.close(result_write)
        worker = cls(process, Connection(request_write, readable=False), Connection(result_read, writable=False))
        try:
            worker._requests.send(tokenizer_info_json())
            if not worker._results.poll(START_TIMEOUT_S):
                raise WorkerGone(f"the grammar worker did not start within {START_TIMEOUT_S:g} s")
            ready = worker._receive()
            if not isinstance(ready, Ready):
                raise WorkerGone(f"the grammar worker answered {ready!r} when it started")
        except BaseException:
            worker.kill()
            worker.reap()
            raise
        return worker

    def trial(self, spec: StructuredOutputs) -> TrialResult:
        """Compiles `spec` in the worker; WorkerGone if the worker is killed (or dies) first."""
        try:
            self._requests.send(Trial(spec))
        except OSError:
            raise WorkerGone("the grammar worker is gone") from None
        result = self._receive()
        if not isinstance(result, TrialResult):
            raise WorkerGone(f"the grammar worker answered {result!r}")
        return result

    @property
    def over_memory(self) -> bool:
        """Whether the (reaped) worker ended because a trial went past its memory budget."""
        return self._process.returncode == OVER_MEMORY_EXIT_CODE

    def kill(self) -> None:
        """Ends the worker at once (SIGKILL); a trial waiting on it raises WorkerGone. Call `reap` after."""
        self._process.kill()  # (nothing once it is reaped)

    def reap(self) -> None:
        """Waits for the ended worker (so no zombie is left) and closes the pipes."""
        self._process.wait()
        self._requests.close()
        self._results.close()

    def close(self) -> None:
        """Stops the worker (end of file on its pipe, SIGKILL if it does not go) and reaps it."""
        self._requests.close()
        try:
            self._process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._results.close()

    def _receive(self) -> Any:
        try:
            return self._results.recv()
        except (EOFError, OSError):
            raise WorkerGone("the grammar worker ended before it answered") from None


def _python() -> str:
    """The interpreter the worker runs: a venv's own, or else the base interpreter's binary (this process
    may embed Python, as Triton's python stub does, whose sys.executable is no Python to run)."""
    if sys.prefix != sys.base_prefix and os.access(sys.executable, os.X_OK):
        return sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for name in (f"python{version}", "python3"):
        candidate = os.path.join(sys.base_exec_prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    if os.path.basename(sys.executable).startswith("python") and os.access(sys.executable, os.X_OK):
        return sys.executable
    raise FileNotFoundError(f"no python{version} in {sys.base_exec_prefix}/bin to run the grammar worker")


def _worker_environment() -> dict[str, str]:
    """This process's environment, its sys.path as the worker's (the stub builds its own and reads no
    PYTHONPATH: triton_backend/model.py), and one OpenMP thread (the worker runs no tensor work)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env["OMP_NUM_THREADS"] = "1"
    return env


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own counsel
        return None


def return_free_memory() -> None:
    """Hands the heap's free pages back to the system: a big compile's scratch memory and a dropped
    grammar are tens of MiB that glibc would otherwise keep in the process for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# -- the worker process ---------------------------------------------------------------------------------


def main(request_fd: int, result_fd: int, memory_budget_bytes: int = 0) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the engine decides
    requests = Connection(request_fd, writable=False)
    results = Connection(result_fd, readable=False)
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def read_requests() -> None:
        while True:
            try:
                inbox.put(requests.recv())
            except (EOFError, OSError):  # the engine closed the pipe or died: nothing to compile for
                os._exit(0)

    threading.Thread(target=read_requests, name="grammar-worker-requests", daemon=True).start()
    compile_trial = _trial_compiler(inbox)
    compiling = threading.Event()
    if memory_budget_bytes > 0:
        limit = _resident_bytes() + memory_budget_bytes  # what a trial may add to the ready worker's memory
        threading.Thread(target=_end_past, args=(limit, compiling), name="grammar-worker-memory", daemon=True).start()
    results.send(Ready(os.getpid()))
    while True:
        request = inbox.get()
        assert isinstance(request, Trial), request
        compiling.set()
        result = compile_trial(request.spec)
        compiling.clear()
        results.send(result)


def _resident_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _end_past(limit_bytes: int, compiling: threading.Event) -> None:
    """Ends the worker once a compile takes its resident memory past `limit_bytes`: xgrammar cannot be
    stopped, and a process's end frees all it took (the engine refuses the constraint on seeing the exit)."""
    while True:
        compiling.wait()
        if _resident_bytes() > limit_bytes:
            os._exit(OVER_MEMORY_EXIT_CODE)
        time.sleep(MEMORY_POLL_S)


def _trial_compiler(inbox: queue.SimpleQueue[Any]) -> Callable[[StructuredOutputs], TrialResult]:
    """The worker's compile, built once its vocabulary comes (the engine's first message, sent while the
    imports run)."""
    import xgrammar as xgr

    from backend.structured_output import build_grammar

    info = xgr.TokenizerInfo.deserialize_json(inbox.get())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_trial(spec: StructuredOutputs) -> TrialResult:
        start = time.perf_counter()
        try:
            compiled = compiler.compile_grammar(build_grammar(spec))
        except InvalidRequestError as e:
            return TrialResult(refusal=e)
        except Exception as e:  # noqa: BLE001 - the engine fails the request with it
            return TrialResult(error=f"{type(e).__name__}: {e}")
        result = TrialResult(compiled.memory_size_bytes, time.perf_counter() - start)
        del compiled
        return_free_memory()
        return result

    return compile_trial


if __name__ == "__main__":
    # By the module's own name, not as __main__: what it sends is unpickled by the engine under that name.
    from backend.grammar_worker import main as worker_main

    worker_main(*map(int, sys.argv[1:]))
