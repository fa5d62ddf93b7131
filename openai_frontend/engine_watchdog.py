"""Knows whether each model's engine is alive, and ends the streams of one that died.

Why: when the Python-backend stub that runs an engine dies (an OOM kill, a crash in a C++ kernel),
Triton keeps the model READY and keeps the gRPC streams of its requests open: nothing would ever
come on them. So the frontend asks. A health probe (docs/wire-contract.md) is answered by the
model's `execute` on Triton's thread, without the engine, with the id of the instance's life; it is
sent every `interval_s` while any stream of the model is open (and on readiness checks, and while
the model is down). A probe that fails or times out marks the model down: its open streams end
with EngineUnavailable at once, and new requests get a 503 until a probe succeeds again. A probe
answered by an instance whose life id changed means the engine was restarted in between: the
streams opened before then end the same way. (With several instances of a model, each answers
probes in turn, under its own instance name.) (Triton's own model control brings the engine back:
scripts/servers.py reloads a model whose stub died.)

Ending a stream is its owner's business: it registers a `kill(reason)` callback and is told.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from openai_frontend.errors import EngineUnavailable, FrontendError

log = logging.getLogger("openai_frontend")

DOWN_RETRY_AFTER_S = 10  # what a 503 tells clients while an engine is restarting


class ProbesUnsupported(Exception):
    """The model has no health probe input: it is taken as alive."""


@dataclass(eq=False)
class Watch:
    """One open stream of `model`."""

    model: str
    kill: Callable[[str], None]


@dataclass
class _ModelHealth:
    lives: dict[str, str] = field(default_factory=dict)  # model instance name -> the id of its current life
    down: str | None = None  # why, while the engine does not answer
    last_probe: float = float("-inf")
    probing: asyncio.Future | None = None
    watches: set[Watch] = field(default_factory=set)
    unsupported: bool = False


class EngineWatchdog:
    def __init__(
        self,
        probe: Callable[[str], Awaitable[str]],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probe = probe
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._clock = clock
        self._models: dict[str, _ModelHealth] = {}
        self._task: asyncio.Task | None = None

    def knows(self, model: str) -> bool:
        return model in self._models

    def is_down(self, model: str) -> bool:
        health = self._models.get(model)
        return health is not None and health.down is not None

    def check(self, model: str) -> None:
        """Raises EngineUnavailable (with Retry-After) while the model's engine is down."""
        health = self._models.get(model)
        if health is not None and health.down is not None:
            raise EngineUnavailable(health.down, retry_after_s=DOWN_RETRY_AFTER_S)

    def watch(self, model: str, kill: Callable[[str], None]) -> Watch:
        health = self._health(model)
        w = Watch(model, kill)
        health.watches.add(w)
        self._ensure_running()
        return w

    def unwatch(self, w: Watch) -> None:
        health = self._models.get(w.model)
        if health is not None:
            health.watches.discard(w)

    def kill_all(self, reason: str) -> int:
        """Ends every open stream (the server is shutting down); returns how many there were."""
        watches = [w for health in self._models.values() for w in health.watches]
        for health in self._models.values():
            health.watches = set()
        for w in watches:
            w.kill(reason)
        return len(watches)

    def report_dead(self, model: str, reason: str) -> None:
        """A request learned that the engine is gone (Triton said its stub is not healthy)."""
        self._mark_down(self._health(model), model, reason)

    async def alive(self, model: str) -> bool:
        """Probes (unless one ran within the interval) and tells whether the engine answers."""
        health = self._health(model)
        if health.unsupported:
            return True
        if self._clock() - health.last_probe >= self.interval_s:
            await self._probe_once(model, health)
        return health.down is None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5)  # (a probe stuck in gRPC must not hold a shutdown)
            self._task = None

    # -- internals ---------------------------------------------------------------------------------

    def _health(self, model: str) -> _ModelHealth:
        return self._models.setdefault(model, _ModelHealth())

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            watched = [(m, h) for m, h in self._models.items() if (h.watches or h.down) and not h.unsupported]
            if not watched:
                return
            for model, health in watched:
                if self._clock() - health.last_probe >= self.interval_s:
                    await self._probe_once(model, health)
            await asyncio.sleep(self.interval_s)

    async def _probe_once(self, model: str, health: _ModelHealth) -> None:
        if health.probing is not None:  # one probe at a time per model; the others wait for it
            await asyncio.shield(health.probing)
            return
        health.probing = asyncio.get_running_loop().create_future()
        try:
            instance = await asyncio.wait_for(self._probe(model), self.timeout_s)
        except ProbesUnsupported:
            health.unsupported = True
        except TimeoutError:
            self._mark_down(
                health,
                model,
                f"the engine of model `{model}` did not answer a health probe within {self.timeout_s:g} s",
            )
        except FrontendError as e:
            self._mark_down(health, model, f"the engine of model `{model}` is not serving: {e.message}")
        else:
            self._mark_up(health, model, instance)
        finally:
            health.last_probe = self._clock()
            health.probing.set_result(None)
            health.probing = None

    def _mark_up(self, health: _ModelHealth, model: str, instance: str) -> None:
        """`instance` is "<model instance name>-<id of its life>": with several instances (count > 1) each
        answers in turn; one whose life changed was restarted, and so was the model (it is reloaded whole):
        the streams open until now were on engines that are gone."""
        if health.down is not None:
            log.warning("model %s is serving again (engine %s)", model, instance)
        health.down = None
        name, _, life = instance.rpartition("-")
        previous = health.lives.get(name)
        health.lives[name] = life
        if previous is not None and previous != life:
            watches, health.watches = health.watches, set()
            for w in watches:
                w.kill(
                    f"the engine of model `{model}` was restarted while this request ran ({name}: {previous} -> {life})"
                )

    def _mark_down(self, health: _ModelHealth, model: str, reason: str) -> None:
        if health.down is None:
            log.error("model %s is down: %s", model, reason)
        health.down = reason
        watches, health.watches = health.watches, set()
        for w in watches:
            w.kill(f"{reason}; this request was not completed (retry in a few seconds)")
        self._ensure_running()  # keep probing until it is back
