"""Compiling structured-outputs constraints, within a time and a memory budget, off every request thread.

A constraint is checked when its request is made (`check`, on the caller's thread): the size limits of
backend/grammar_limits.py first, then xgrammar's parse; both are cheap next to compiling. Compiling (the
grammar against the vocabulary: which tokens each grammar state allows) then runs off the caller's thread,
and the engine keeps the request out of the scheduler until `compiled(spec)` is done.

The budget. A compile cannot be interrupted, so each constraint is first compiled on trial in a worker
process (backend/grammar_worker.py), which is killed if the trial is not done within `timeout_s` of the
check, and ends itself if the compile grows its memory by more than `compile_memory_bytes`: the constraint
is refused (an InvalidRequestError naming `structured_outputs.<kind>`) and the compile's thread, core and
memory are freed at once; another worker takes the ended one's seat. A
constraint whose trial compiled in time is compiled again here, taking about as long as its trial (the
compiled grammar costs more to send across than to compile again), unless its grammar is larger than
`max_grammar_bytes`: then it is refused without being compiled here. Specs refused so are remembered a
while (by digest) and refused again at once. Compiled grammars are cached by spec up to `cache_bytes`
(least recently used out first); xgrammar's own cache is off, so a dropped grammar is freed.

The lanes. Compile time grows fast with a constraint's size, so constraints are sorted by the length
of their text: short ones compile in the small lane, long ones in the big lane, and a big compile never
takes a small one's seat. Each seat has its worker, started at the lane's first constraint and kept warm. The
small lane queues a few; the big lane queues none: while its seats are taken a big constraint is refused
at once as overloaded (retry later) rather than queued behind a compile that may run to its budget. A
constraint that waits past its time for a seat, or for the worker of its seat to start again after a
kill, is refused as overloaded too; only one checked before its lane's first worker was up waits for it
(seconds, once), and its budget starts with its trial.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.grammar_limits import DEFAULT_LIMITS, GrammarLimits, check_limits
from backend.grammar_worker import WORKER_MODULE, GrammarWorker, TrialResult, WorkerGone, return_free_memory
from backend.structured_output import build_grammar
from protocol import EngineOverloaded, InvalidRequestError, StructuredOutputs

if TYPE_CHECKING:
    import xgrammar

    from backend.config import EngineConfig
    from tokenization.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

SMALL_CONSTRAINT_CHARS = 16384  # constraints of at most this much text compile in the small lane
SMALL_LANE_SEATS = 2
SMALL_LANE_QUEUE = 64
BIG_LANE_SEATS = 1
CACHE_ENTRIES = 256  # besides the byte bound: many tiny grammars still cost a dict entry and a spec each
REFUSALS_KEPT = 1024
REFUSAL_MEMORY_S = 600.0  # a spec once too complex is refused at once this long (load varies, so not forever)


@dataclass(frozen=True, slots=True)
class GrammarBudget:
    """What one constraint may cost to compile, and what the compiled ones may hold together."""

    timeout_s: float = 5.0
    max_grammar_bytes: int = 32 << 20
    cache_bytes: int = 256 << 20
    compile_memory_bytes: int = 1 << 30  # what one trial compile may add to its worker's resident memory

    @classmethod
    def from_config(cls, config: EngineConfig) -> GrammarBudget:
        return cls(
            config.grammar_compile_timeout_s,
            config.grammar_max_mib << 20,
            config.grammar_cache_mib << 20,
            config.grammar_compile_memory_mib << 20,
        )


@dataclass(frozen=True, slots=True)
class CompilerStats:
    """A snapshot of the compiler (metrics, tests)."""

    cached_grammars: int
    cached_bytes: int
    small_lane_running: int  # compiles holding a seat
    big_lane_running: int
    small_lane_waiting: int
    small_lane_workers: tuple[int, ...]  # the process ids of the lane's started workers
    big_lane_workers: tuple[int, ...]


class _Phase(enum.Enum):
    WAITING = "waiting"  # in its lane's queue
    STARTING = "starting"  # holds a seat, waiting for the seat's worker to be ready
    TRIAL = "trial"  # compiling in a worker: killed at its deadline
    FINAL = "final"  # passed its trial, compiling here: takes about as long as the trial did


@dataclass(slots=True, eq=False)
class _Lane:
    name: str
    seats: int
    queue_limit: int
    running: int = 0
    waiting: deque[_Compile] = field(default_factory=deque)
    # A worker per seat, started at the lane's first constraint: the ready ones wait here (or why one did not
    # start); a compile takes one for its trial and gives it back, or, when it was killed, has another
    # started in its place.
    ready: queue.SimpleQueue[GrammarWorker | BaseException] = field(default_factory=queue.SimpleQueue)
    started: int = 0  # workers started (ready, busy or starting): never fewer than the compiles running
    pids: set[int] = field(default_factory=set)  # the started workers that are up, ready or busy
    warm: bool = False  # a worker of this lane has been ready: a wait for one is now a wait for a restart
    closed: bool = False

    @property
    def has_seat(self) -> bool:
        return self.running < self.seats

    @property
    def is_full(self) -> bool:
        return not self.has_seat and len(self.waiting) >= self.queue_limit


@dataclass(slots=True, eq=False)
class _Compile:
    """One spec's compile, from its check until it is settled (cached, refused or dropped)."""

    spec: StructuredOutputs
    grammar: xgrammar.Grammar | None  # released once compiled
    lane: _Lane
    cold: bool  # checked before its lane had a worker up: its budget starts when its trial does
    future: Future[Any] = field(default_factory=Future)
    timer: threading.Timer | None = None
    timers: int = 0  # the timers armed: only the last one counts
    phase: _Phase = _Phase.WAITING
    worker: GrammarWorker | None = None  # during its trial
    killed: bool = False  # its worker was killed at the deadline
    settled: bool = False  # its outcome is decided: by the compile, or by the deadline before it
    size_bytes: int = 0  # of the compiled grammar, once cached


class _Vocabulary:
    """The vocabulary as xgrammar sees it, made once on first use, for this process's compiler and the
    workers' (as JSON). Thread-safe."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._info: xgrammar.TokenizerInfo | None = None
        self._info_json: str | None = None

    def info(self) -> xgrammar.TokenizerInfo:
        with self._lock:
            if self._info is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                backend = self._tokenizer.backend
                hf = PreTrainedTokenizerFast(
                    tokenizer_object=type(backend).from_str(backend.to_str())
                )  # a copy: HF may change it
                self._info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids
                )
            return self._info

    def info_json(self) -> str:
        info = self.info()
        with self._lock:
            if self._info_json is None:
                self._info_json = info.serialize_json()
            return self._info_json


class StructuredOutputCompiler:
    """Checks specs and compiles them within the budget, cached by spec. Thread-safe. `close` ends its
    workers (they end with this process too, however it ends)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        budget: GrammarBudget = GrammarBudget(),
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        self._vocabulary = _Vocabulary(tokenizer, vocab_size, stop_token_ids)
        self.budget = budget
        self._limits = limits
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None  # built by the first compile's thread
        self._cache: OrderedDict[StructuredOutputs, _Compile] = OrderedDict()  # compiling, then compiled
        self._cached_bytes = 0
        self._freed = False  # grammars were let go since the heap was last trimmed
        self._refused: OrderedDict[bytes, tuple[float, InvalidRequestError]] = OrderedDict()  # digest -> until, why
        self._small = _Lane("small", SMALL_LANE_SEATS, SMALL_LANE_QUEUE)
        self._big = _Lane("big", BIG_LANE_SEATS, 0)
        self._worker_module = WORKER_MODULE  # (tests run a gated one)
        self._closed = False
        # The workers end when this compiler is collected or the interpreter exits, if `close` was not called.
        self._finalizer = weakref.finalize(self, _close_lanes, (self._small, self._big))

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidRequestError if spec is over a limit, does not parse or was refused lately
        (EngineOverloaded if its lane is full); start compiling it if it is not cached."""
        self._start(spec)

    def compiled(self, spec: StructuredOutputs) -> Future[xgrammar.CompiledGrammar]:
        """The compilation of a checked spec: done at once on a cache hit, and within the time budget
        of its check otherwise (its compile here, after its trial, takes about as long again); a refusal
        is the future's InvalidRequestError."""
        try:
            return self._start(spec)
        except InvalidRequestError as e:  # evicted since it was checked, and refused this time
            future: Future[Any] = Future()
            future.set_exception(e)
            return future

    def warm_up(self, timeout_s: float = 120.0) -> None:
        """Starts every lane's workers now and waits until each is ready (a lane starts them at its first
        constraint otherwise); TimeoutError past `timeout_s`."""
        with self._lock:
            for lane in (self._small, self._big):
                while lane.started < lane.seats:
                    self._start_worker(lane)
        deadline = time.monotonic() + timeout_s
        while not all(lane.warm and len(lane.pids) == lane.seats for lane in (self._small, self._big)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the grammar workers were not ready within {timeout_s:g} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Ends every worker (a trial running is killed, its constraint refused) and fails what waits;
        later constraints fail too."""
        with self._lock:
            self._closed = True
            for lane in (self._small, self._big):
                lane.closed = True
            for job in list(self._cache.values()):
                if job.settled:
                    continue
                if job.phase is _Phase.TRIAL and job.worker is not None:
                    job.killed = True
                    job.worker.kill()
                elif job.phase is not _Phase.WAITING:
                    continue  # it ends on its own (a compile here, or a wait for a worker the close ends)
                else:
                    job.lane.waiting.remove(job)
                job.settled = True
                self._forget(job)
                if job.timer is not None:
                    job.timer.cancel()
                job.future.set_exception(RuntimeError("the engine stopped"))
        self._finalizer()

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(
                sum(job.size_bytes > 0 for job in self._cache.values()),
                self._cached_bytes,
                self._small.running,
                self._big.running,
                len(self._small.waiting),
                tuple(sorted(self._small.pids)),
                tuple(sorted(self._big.pids)),
            )

    def _start(self, spec: StructuredOutputs) -> Future[Any]:
        check_limits(spec, self._limits)
        with self._lock:
            self._raise_if_refused(spec)
            entry = self._cache.get(spec)
            if entry is not None:
                self._cache.move_to_end(spec)
                return entry.future
        grammar = build_grammar(spec)  # raises for a bad spec
        with self._lock:
            entry = self._cache.get(spec)  # another caller's check may have started it meanwhile
            if entry is not None:
                return entry.future
            return self._submit(spec, grammar)

    def _raise_if_refused(self, spec: StructuredOutputs) -> None:
        digest = _digest(spec)
        remembered = self._refused.get(digest)
        if remembered is None:
            return
        until, refusal = remembered
        if time.monotonic() >= until:
            del self._refused[digest]
            return
        raise InvalidRequestError(refusal.message, refusal.param, refusal.code)

    def _submit(self, spec: StructuredOutputs, grammar: xgrammar.Grammar) -> Future[Any]:
        if self._closed:
            stopped: Future[Any] = Future()
            stopped.set_exception(RuntimeError("the engine stopped"))
            return stopped
        lane = self._small if _constraint_chars(spec) <= SMALL_CONSTRAINT_CHARS else self._big
        if lane.is_full:
            raise EngineOverloaded(
                f"the server is compiling as many {lane.name} constraints as it can; retry later",
                f"structured_outputs.{spec.kind}",
                "overloaded",
            )
        job = _Compile(spec, grammar, lane, cold=not lane.warm)
        self._arm(job)
        self._cache[spec] = job
        if lane.has_seat:
            self._run_in_thread(job)
        else:
            lane.waiting.append(job)
        return job.future

    def _arm(self, job: _Compile) -> None:
        """(Re)starts the job's time budget."""
        if job.timer is not None:
            job.timer.cancel()
        job.timers += 1
        job.timer = threading.Timer(self.budget.timeout_s, self._on_deadline, (job, job.timers))
        job.timer.daemon = True
        job.timer.start()

    def _start_worker(self, lane: _Lane) -> None:
        """A worker for a seat of `lane`, started on a thread of its own (seconds) and queued when ready."""
        lane.started += 1
        threading.Thread(
            target=_start_worker,
            args=(lane, self._vocabulary, self._worker_module, self.budget.compile_memory_bytes),
            name=f"grammar-worker-start-{lane.name}",
            daemon=True,
        ).start()

    def _run_in_thread(self, job: _Compile) -> None:
        job.phase = _Phase.STARTING
        job.lane.running += 1
        while job.lane.started < job.lane.seats:  # the lane's first constraint starts its workers
            self._start_worker(job.lane)
        threading.Thread(
            target=self._compile, args=(job,), name=f"grammar-compile-{job.lane.name}", daemon=True
        ).start()

    def _compile(self, job: _Compile) -> None:
        lane = job.lane
        try:
            outcome = self._trial_then_compile(job)
        except Exception as e:  # noqa: BLE001 - the request ends with it; the lane goes on
            outcome = e
        job.grammar = None
        with self._lock:
            lane.running -= 1
            self._start_waiting(lane)
            result = self._settle(job, outcome)
            freed, self._freed = self._freed, False
        del outcome  # a dropped grammar goes here
        if result is not None:
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
        if lane is self._big or freed:
            return_free_memory()

    def _trial_then_compile(self, job: _Compile) -> Any:
        """The compiled grammar, or the exception the job ends with (None: the deadline settled it)."""
        worker = job.lane.ready.get()
        if isinstance(worker, BaseException):
            with self._lock:
                job.lane.started -= 1  # the next compile to take the seat tries again
            return RuntimeError(f"the grammar worker did not start: {worker}")
        with self._lock:
            if job.settled:  # refused as overloaded while the worker was starting
                job.lane.ready.put(worker)
                return None
            job.phase, job.worker = _Phase.TRIAL, worker
            if job.cold:  # it waited for its lane's first worker to start: the budget is its trial's
                self._arm(job)
        try:
            trial: TrialResult | None = worker.trial(job.spec)
        except WorkerGone:
            trial = None
        with self._lock:
            job.worker = None
            killed = job.killed
            if trial is not None and not killed:
                job.phase = _Phase.FINAL  # (from here on the deadline leaves it be)
        if trial is None or killed:
            worker.reap()
            job.lane.pids.discard(worker.pid)
            with self._lock:
                job.lane.started -= 1
                if not job.lane.closed:
                    self._start_worker(job.lane)  # at once, so that the seat's next compile waits the least
            if killed:
                return None  # refused at its deadline
            if worker.over_memory:
                return self._refuse(
                    job.spec,
                    "the constraint is too complex: compiling it takes more than "
                    f"{self.budget.compile_memory_bytes / 2**20:.0f} MiB of memory; make it smaller, e.g. fewer "
                    "enum values, choices or optional properties",
                )
            return RuntimeError("the grammar worker ended while compiling it (it may have run out of memory)")
        job.lane.ready.put(worker)
        if job.lane.closed:  # closed during the trial: the worker it gave back ends too
            _close_lanes((job.lane,))
        if trial.refusal is not None:
            return trial.refusal
        if trial.error is not None:
            return RuntimeError(trial.error)
        if trial.size_bytes > self.budget.max_grammar_bytes:
            return self._too_big(job.spec, trial.size_bytes)
        return self._grammar_compiler().compile_grammar(job.grammar)

    def _settle(self, job: _Compile, outcome: Any) -> Any:
        """What the job's future gets (None: nothing, the deadline refused it first); caches what fits."""
        if job.settled or outcome is None:
            return None
        job.settled = True
        if job.timer is not None:
            job.timer.cancel()
        if isinstance(outcome, BaseException):
            self._forget(job)
            if not isinstance(outcome, InvalidRequestError):
                logger.error("compiling a %s constraint failed: %s", job.spec.kind, outcome)
            return outcome
        size = outcome.memory_size_bytes
        if size > self.budget.max_grammar_bytes:  # (its trial said otherwise: not expected)
            self._forget(job)
            self._freed = True
            return self._too_big(job.spec, size)
        job.size_bytes = size
        self._cached_bytes += size
        self._cache.move_to_end(job.spec)
        self._evict()
        return outcome

    def _too_big(self, spec: StructuredOutputs, size: int) -> InvalidRequestError:
        return self._refuse(
            spec,
            f"the constraint is too complex: it compiles to {size / 2**20:.1f} MiB of grammar, and this "
            f"server keeps at most {self.budget.max_grammar_bytes / 2**20:.1f} MiB per constraint",
        )

    def _on_deadline(self, job: _Compile, timer: int) -> None:
        with self._lock:
            if job.settled or job.phase is _Phase.FINAL or timer != job.timers:
                return
            if job.cold and job.phase in (_Phase.WAITING, _Phase.STARTING):
                self._arm(job)  # its lane's first workers are still starting (seconds, once): it waits on
                return
            job.settled = True
            self._forget(job)
            if job.phase is _Phase.TRIAL:
                refusal = self._refuse(
                    job.spec,
                    f"the constraint is too complex to compile in time (not within {self.budget.timeout_s:g} s): "
                    "make it smaller, e.g. fewer enum values, choices or optional properties",
                )
                assert job.worker is not None
                job.killed = True
                job.worker.kill()  # its thread, core and memory are free at once; another worker takes the seat
            else:
                if job.phase is _Phase.WAITING:
                    job.lane.waiting.remove(job)
                refusal = EngineOverloaded(
                    f"the server was busy compiling other constraints for all of {self.budget.timeout_s:g} s; "
                    "retry later",
                    f"structured_outputs.{job.spec.kind}",
                    "overloaded",
                )
        job.future.set_exception(refusal)

    def _start_waiting(self, lane: _Lane) -> None:
        while lane.has_seat and lane.waiting:
            self._run_in_thread(lane.waiting.popleft())

    def _refuse(self, spec: StructuredOutputs, message: str) -> InvalidRequestError:
        refusal = InvalidRequestError(message, f"structured_outputs.{spec.kind}")
        self._refused[_digest(spec)] = (time.monotonic() + REFUSAL_MEMORY_S, refusal)
        while len(self._refused) > REFUSALS_KEPT:
            self._refused.popitem(last=False)
        return refusal

    def _forget(self, job: _Compile) -> None:
        if self._cache.get(job.spec) is job:
            del self._cache[job.spec]
            self._cached_bytes -= job.size_bytes
            self._freed |= job.size_bytes > 0

    def _evict(self) -> None:
        """Drops the least recently used compiled grammars until the cache is within its bounds (those
        still compiling stay: their requests wait on them)."""
        for job in list(self._cache.values()):
            if self._cached_bytes <= self.budget.cache_bytes and len(self._cache) <= CACHE_ENTRIES:
                return
            if job.settled:
                self._forget(job)

    def _grammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def _make_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar as xgr

        # No cache of its own: ours, in front, is bounded in bytes, and a grammar we drop must be freed.
        return xgr.GrammarCompiler(self._vocabulary.info(), max_threads=1, cache_enabled=False)


def _start_worker(lane: _Lane, vocabulary: _Vocabulary, module: str, memory_budget_bytes: int) -> None:
    """Starts a worker for `lane` and queues it, or why it did not start (a thread of its own; holds no
    reference to the compiler, so that a dropped compiler is collected and its workers end)."""
    try:
        worker = GrammarWorker.start(vocabulary.info_json, module, memory_budget_bytes)
    except Exception as e:  # noqa: BLE001 - the compile that takes it fails with it
        logger.error("a grammar worker did not start: %s", e)
        lane.ready.put(e)
        return
    lane.pids.add(worker.pid)
    lane.warm = True
    lane.ready.put(worker)
    if lane.closed:  # closed while it started
        _close_lanes((lane,))


def _close_lanes(lanes: tuple[_Lane, ...]) -> None:
    """Ends the lanes' ready workers and wakes the compiles waiting for one (a busy worker ends when its
    compile hands it back, or is killed by `close`)."""
    for lane in lanes:
        lane.closed = True
        while True:
            try:
                worker = lane.ready.get_nowait()
            except queue.Empty:
                break
            if isinstance(worker, GrammarWorker):
                worker.close()
                lane.pids.discard(worker.pid)
        for _ in range(lane.seats):
            lane.ready.put(RuntimeError("the engine stopped"))


def _constraint_chars(spec: StructuredOutputs) -> int:
    """The length of the constraint's text: what sorts it into a lane."""
    if spec.choice is not None:
        return sum(len(c) for c in spec.choice) + len(spec.choice)
    return len(spec.json or spec.regex or spec.grammar or "")


def _digest(spec: StructuredOutputs) -> bytes:
    return hashlib.blake2b(repr(spec).encode(), digest_size=16).digest()
