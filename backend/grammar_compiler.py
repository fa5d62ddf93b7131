"""Compiling structured-outputs constraints, within a time and a memory budget, off every request thread.

A constraint is checked when its request is made (`check`, on the caller's thread): the size limits of
backend/grammar_limits.py first, then xgrammar's parse; both are cheap next to compiling. Compiling (the
grammar against the vocabulary: which tokens each grammar state allows) then runs on a thread of its
own, and the engine keeps the request out of the scheduler until `compiled(spec)` is done.

The budget. Every compile's future is done within `timeout_s` of its check: with the compiled grammar,
or with an InvalidRequestError naming `structured_outputs.<kind>`. A compile cannot be interrupted, so
one past its time keeps running, but its result is dropped when it comes, never cached; a grammar
larger than `max_grammar_bytes` is refused and dropped too. Specs refused so are remembered a while
(by digest) and refused again at once. Compiled grammars are cached by spec up to `cache_bytes`
(least recently used out first); xgrammar's own cache is off, so a dropped grammar is freed.

The lanes. Compile time grows fast with a constraint's size, so constraints are sorted by the length
of their text: short ones compile in the small lane, long ones in the big lane, and a big compile never
takes a small one's seat. The small lane queues a few; the big lane queues none: while its seats are
taken a big constraint is refused at once as overloaded (retry later) rather than queued behind a
compile that may run for minutes. A short constraint that still runs past its time is a big one after
all: it moves to the big lane when a seat there is free, giving its small seat to the next.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backend.grammar_limits import DEFAULT_LIMITS, GrammarLimits, check_limits
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

    @classmethod
    def from_config(cls, config: EngineConfig) -> GrammarBudget:
        return cls(config.grammar_compile_timeout_s, config.grammar_max_mib << 20, config.grammar_cache_mib << 20)


@dataclass(frozen=True, slots=True)
class CompilerStats:
    """A snapshot of the compiler (metrics, tests)."""

    cached_grammars: int
    cached_bytes: int
    small_lane_running: int  # compiles holding a seat, those past their time included
    big_lane_running: int
    small_lane_waiting: int


@dataclass(slots=True)
class _Lane:
    name: str
    seats: int
    queue_limit: int
    running: int = 0
    waiting: deque[_Compile] = field(default_factory=deque)

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
    future: Future[Any] = field(default_factory=Future)
    timer: threading.Timer | None = None
    started: bool = False
    settled: bool = False  # its outcome is decided: by the compile, or by the deadline before it
    size_bytes: int = 0  # of the compiled grammar, once cached


class StructuredOutputCompiler:
    """Checks specs and compiles them within the budget, cached by spec. Thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        budget: GrammarBudget = GrammarBudget(),
        limits: GrammarLimits = DEFAULT_LIMITS,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
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

    def check(self, spec: StructuredOutputs) -> None:
        """Raise InvalidRequestError if spec is over a limit, does not parse or was refused lately
        (EngineOverloaded if its lane is full); start compiling it if it is not cached."""
        self._start(spec)

    def compiled(self, spec: StructuredOutputs) -> Future[xgrammar.CompiledGrammar]:
        """The compilation of a checked spec: done at once on a cache hit, and within the time budget
        of its check otherwise; a refusal is the future's InvalidRequestError."""
        try:
            return self._start(spec)
        except InvalidRequestError as e:  # evicted since it was checked, and refused this time
            future: Future[Any] = Future()
            future.set_exception(e)
            return future

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(
                sum(job.size_bytes > 0 for job in self._cache.values()),
                self._cached_bytes,
                self._small.running,
                self._big.running,
                len(self._small.waiting),
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
        lane = self._small if _constraint_chars(spec) <= SMALL_CONSTRAINT_CHARS else self._big
        if lane.is_full:
            raise EngineOverloaded(
                f"the server is compiling as many {lane.name} constraints as it can; retry later",
                f"structured_outputs.{spec.kind}",
                "overloaded",
            )
        job = _Compile(spec, grammar, lane)
        job.timer = threading.Timer(self.budget.timeout_s, self._on_deadline, (job,))
        job.timer.daemon = True
        job.timer.start()
        self._cache[spec] = job
        if lane.has_seat:
            self._run_in_thread(job)
        else:
            lane.waiting.append(job)
        return job.future

    def _run_in_thread(self, job: _Compile) -> None:
        job.started = True
        job.lane.running += 1
        threading.Thread(
            target=self._compile, args=(job,), name=f"grammar-compile-{job.lane.name}", daemon=True
        ).start()

    def _compile(self, job: _Compile) -> None:
        try:
            compiled, error = self._grammar_compiler().compile_grammar(job.grammar), None
        except Exception as e:  # noqa: BLE001 - the request ends with it; the lane goes on
            compiled, error = None, e
        job.grammar = None
        with self._lock:
            ran_big = job.lane is self._big
            job.lane.running -= 1
            self._start_waiting(job.lane)
            outcome = self._settle(job, compiled, error)
            freed, self._freed = self._freed, False
        del compiled  # a dropped grammar goes here
        if outcome is not None:
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
        if ran_big or freed:
            _return_free_memory()

    def _settle(self, job: _Compile, compiled: Any, error: Exception | None) -> Any:
        """What the job's future gets (None: nothing, the deadline refused it first); caches what fits."""
        if job.settled:
            logger.info("a %s constraint compiled past its time budget; its grammar is dropped", job.spec.kind)
            self._freed = True
            return None
        job.settled = True
        if job.timer is not None:
            job.timer.cancel()
        if error is not None:
            self._forget(job)
            logger.error("compiling a %s constraint failed: %s", job.spec.kind, error)
            return error
        size = compiled.memory_size_bytes
        if size > self.budget.max_grammar_bytes:
            self._forget(job)
            self._freed = True
            return self._refuse(
                job.spec,
                f"the constraint is too complex: it compiles to {size / 2**20:.1f} MiB of grammar, and this "
                f"server keeps at most {self.budget.max_grammar_bytes / 2**20:.1f} MiB per constraint",
            )
        job.size_bytes = size
        self._cached_bytes += size
        self._cache.move_to_end(job.spec)
        self._evict()
        return compiled

    def _on_deadline(self, job: _Compile) -> None:
        with self._lock:
            if job.settled:
                return
            job.settled = True
            self._forget(job)
            if job.started:
                refusal = self._refuse(
                    job.spec,
                    f"the constraint is too complex to compile in time (not within {self.budget.timeout_s:g} s): "
                    "make it smaller, e.g. fewer enum values, choices or optional properties",
                )
                self._promote(job)
            else:
                job.lane.waiting.remove(job)
                refusal = EngineOverloaded(
                    f"the server was busy compiling other constraints for all of {self.budget.timeout_s:g} s; "
                    "retry later",
                    f"structured_outputs.{job.spec.kind}",
                    "overloaded",
                )
        job.future.set_exception(refusal)

    def _promote(self, job: _Compile) -> None:
        """A small-lane compile past its time is a big one: it takes a free big seat, so its small seat
        goes to the next small constraint."""
        if job.lane is self._small and self._big.has_seat:
            self._small.running -= 1
            self._big.running += 1
            job.lane = self._big
            self._start_waiting(self._small)

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
        from transformers import PreTrainedTokenizerFast

        backend = self._tokenizer.backend
        hf = PreTrainedTokenizerFast(
            tokenizer_object=type(backend).from_str(backend.to_str())
        )  # a copy: HF may change it
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
        # No cache of its own: ours, in front, is bounded in bytes, and a grammar we drop must be freed.
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own counsel
        return None


def _return_free_memory() -> None:
    """Hands the heap's free pages back to the system: a big compile's scratch memory and a dropped
    grammar are tens of MiB that glibc would otherwise keep in the process for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _constraint_chars(spec: StructuredOutputs) -> int:
    """The length of the constraint's text: what sorts it into a lane."""
    if spec.choice is not None:
        return sum(len(c) for c in spec.choice) + len(spec.choice)
    return len(spec.json or spec.regex or spec.grammar or "")


def _digest(spec: StructuredOutputs) -> bytes:
    return hashlib.blake2b(repr(spec).encode(), digest_size=16).digest()
