"""One OpenAI request's engine work: one engine request per prompt, run concurrently, merged into
one checked stream of (prompt_index, StepOutput).

Every StepOutput is checked against the state of its sequence, keyed by (prompt_index, seq_index),
before anyone renders it (invariants 2 and 3 of docs/contract.md):
- `step` is the next one expected (from 0, no gap, no repeat);
- nothing arrives for a sequence after its finish, and every sequence finishes exactly once;
- `num_output_tokens` equals the tokens received so far (so usage == tokens streamed);
- with logprobs requested, one logprob entry per token.
A violation raises StreamIntegrityError and counts in the integrity metric; the caller ends the
stream with an error, so a corrupted text is never sent.

Closing the `events()` iterator early (client gone, a violation, an error) closes each engine stream
(for several prompts by cancelling the tasks that read them) and so cancels the Triton requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import EngineFailure, FrontendError, InvalidRequest, StreamIntegrityError
from openai_frontend.metrics import Metrics
from openai_frontend.request_log import RequestRecord, clipped
from protocol import AdmissionGroup, RequestTimings, SamplingParams, StepOutput
from protocol.errors import TOO_MANY_SEQUENCES


@dataclass(slots=True)
class _SeqState:
    next_step: int = 0
    finished: bool = False
    finish_reason: str | None = None  # the engine's, for the access log
    tokens: int = 0
    last_token_time: float | None = None


# Messages from the producer tasks to the consumer (one queue per Generation).
@dataclass(frozen=True, slots=True)
class _Output:
    prompt_index: int
    out: StepOutput


@dataclass(frozen=True, slots=True)
class _End:
    prompt_index: int


@dataclass(frozen=True, slots=True)
class _Failed:
    error: FrontendError


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those whose KV the engine found in its prefix cache

    def without_completion(self) -> Usage:
        """The usage of a chunk or response that shows none of the completed tokens."""
        return Usage(self.prompt_tokens, 0, self.cached_tokens)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's chat and completions usage."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        model: str,
        prompts: Sequence[str | tuple[int, ...]],
        params: SamplingParams,
        request_id: str,
        metrics: Metrics,
        arrival: float | None = None,
        record: RequestRecord | None = None,
    ) -> None:
        self.engine, self.model, self.prompts, self.params = engine, model, prompts, params
        self.request_id, self.metrics, self.record = request_id, metrics, record
        self.arrival = time.monotonic() if arrival is None else arrival
        # One state per sequence, keyed by (prompt_index, seq_index).
        self._seqs = {(p, s): _SeqState() for p in range(len(prompts)) for s in range(params.n)}
        self._prompt_tokens: dict[int, int] = {}  # prompt_index -> num_prompt_tokens, once heard from
        self._cached_tokens: dict[int, int] = {}  # prompt_index -> num_cached_tokens, once heard from
        self._completion_tokens = 0
        self._first_token_time: float | None = None
        self._end_time: float | None = None
        # Each finished sequence's engine timings and when its last message came, for the access log and trace.
        self._timings: list[tuple[RequestTimings, float]] = []
        # --log-requests: each sequence's text, kept by a wrapper of the events (no cost otherwise).
        self._texts: dict[tuple[int, int], list[str]] | None = {} if record and record.log_texts else None
        # Several prompts are several engine requests: the engine's queue bound admits them as one.
        self._admission_group = AdmissionGroup(request_id, len(prompts)) if len(prompts) > 1 else None

    @property
    def usage(self) -> Usage:
        """Running usage: prompt tokens of the prompts heard from so far, tokens received so far."""
        return Usage(sum(self._prompt_tokens.values()), self._completion_tokens, sum(self._cached_tokens.values()))

    def events(self) -> AsyncIterator[tuple[int, StepOutput]]:
        return self._events() if self._texts is None else self._kept_texts(self._events(), self._texts)

    async def _kept_texts(
        self, events: AsyncIterator[tuple[int, StepOutput]], texts: dict[tuple[int, int], list[str]]
    ) -> AsyncIterator[tuple[int, StepOutput]]:
        async with aclosing(events):
            async for p, out in events:
                texts.setdefault((p, out.seq_index), []).append(out.text_delta)
                yield p, out

    async def _events(self) -> AsyncIterator[tuple[int, StepOutput]]:
        self.metrics.requests_in_flight.inc()
        self.metrics.in_flight += 1
        try:
            if len(self.prompts) == 1:
                # One engine request (most are): read here, without a producer task and a queue, whose
                # hand-off would cost every token a task switch.
                async with aclosing(self._engine_outputs(0, self.prompts[0])) as outputs:
                    async for out in outputs:
                        self._check(0, out)
                        yield 0, out
                self._check_all_finished(0)
            else:
                async with aclosing(self._merged()) as merged:
                    async for item in merged:
                        yield item
        finally:
            self.metrics.requests_in_flight.dec()
            self.metrics.in_flight -= 1
            self._end_time = time.monotonic()
            self.metrics.e2e_request_latency.observe(self._end_time - self.arrival)
            if self.record is not None:
                self._report(self.record)

    def _report(self, record: RequestRecord) -> None:
        """The access log's numbers (request_log.py), added once at the end: nothing per token."""
        usage = self.usage
        record.generated = True
        record.prompt_tokens += usage.prompt_tokens
        record.completion_tokens += usage.completion_tokens
        record.cached_tokens += usage.cached_tokens
        if record.ttft_s is None and self._first_token_time is not None:
            record.ttft_s = self._first_token_time - self.arrival
        if self._end_time is not None:
            record.e2e_s = max(record.e2e_s or 0.0, self._end_time - self.arrival)
        for timings, received_at in self._timings:
            record.add_engine_timings(timings, received_at)
        record.model, record.params = self.model, self.params
        record.finish_reasons += [self._seqs[key].finish_reason for key in sorted(self._seqs)]
        if self._texts is not None:
            record.prompts += [clipped(p if isinstance(p, str) else str(list(p))) for p in self.prompts]
            record.outputs += [clipped("".join(self._texts.get(key, ()))) for key in sorted(self._seqs)]

    async def _merged(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """Every prompt's engine request read by a task of its own, their outputs merged as they come."""
        queue: asyncio.Queue[_Output | _End | _Failed] = asyncio.Queue()
        tasks = [asyncio.create_task(self._produce(p, prompt, queue)) for p, prompt in enumerate(self.prompts)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, _Failed):
                    raise item.error
                if isinstance(item, _End):
                    running -= 1
                    self._check_all_finished(item.prompt_index)
                    continue
                self._check(item.prompt_index, item.out)
                yield item.prompt_index, item.out
        finally:
            for task in tasks:
                task.cancel()
            # Under a cancelled anyio scope (Starlette on disconnect) this await may be interrupted;
            # the tasks are cancelled all the same and close their engine streams on their own.
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _produce(self, p: int, prompt: str | tuple[int, ...], queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self._engine_outputs(p, prompt)) as outputs:
                async for out in outputs:
                    queue.put_nowait(_Output(p, out))
            queue.put_nowait(_End(p))
        except FrontendError as e:
            if isinstance(e, InvalidRequest) and e.param == "prompt" and e.code != TOO_MANY_SEQUENCES:
                e.param = f"prompt.{p}"  # the engine refused this prompt of several: name it
            queue.put_nowait(_Failed(e))

    async def _engine_outputs(self, p: int, prompt: str | tuple[int, ...]) -> AsyncIterator[StepOutput]:
        """Prompt p's engine request, until all its sequences finished; any failure as a FrontendError."""
        engine_prompt = prompt if isinstance(prompt, str) else list(prompt)
        finished: set[int] = set()
        try:
            stream = self.engine.generate(
                self.model,
                engine_prompt,
                self.params,
                f"{self.request_id}-{p}",
                self._admission_group,
                headers=None if self.record is None else self.record.trace_headers,
            )
            async with aclosing(stream):
                async for out in stream:
                    yield out
                    if out.finish_reason is not None:
                        finished.add(out.seq_index)
                        if len(finished) == self.params.n:
                            return  # all sequences done: do not wait on the engine for more
        except FrontendError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug in a client must end the request, not hang it
            raise EngineFailure(f"engine client failed: {type(e).__name__}: {e}") from None

    # -- checks ----------------------------------------------------------------------------------

    def _violation(self, p: int, seq: int, what: str) -> StreamIntegrityError:
        self.metrics.integrity_violations.inc()
        return StreamIntegrityError(
            f"stream integrity violation in request {self.request_id}, prompt {p}, sequence {seq}: {what}"
        )

    def _check(self, p: int, out: StepOutput) -> None:
        n = self.params.n
        if not 0 <= out.seq_index < n:
            raise self._violation(p, out.seq_index, f"seq_index out of range for n={n}")
        state = self._seqs[(p, out.seq_index)]
        if state.finished:
            raise self._violation(p, out.seq_index, f"response (step {out.step}) after the sequence finished")
        if out.step != state.next_step:
            kind = "repeated" if out.step < state.next_step else "gap before"
            raise self._violation(p, out.seq_index, f"{kind} step {out.step} (expected {state.next_step})")
        ntok = len(out.token_ids)
        lp = out.logprobs
        lp_complete = lp is not None and len(lp.logprobs) == len(lp.token_texts) == len(lp.top_token_ids) == ntok
        if self.params.logprobs is not None and (lp is not None or ntok) and not lp_complete:
            raise self._violation(
                p, out.seq_index, f"logprob entries do not match the {ntok} tokens of step {out.step}"
            )
        if state.tokens + ntok != out.num_output_tokens:
            raise self._violation(
                p,
                out.seq_index,
                f"num_output_tokens {out.num_output_tokens} at step {out.step} "
                f"but {state.tokens + ntok} tokens received",
            )
        # Accept the message: update the sequence state, usage and latency metrics.
        state.next_step += out.num_steps
        state.tokens += ntok
        if out.finish_reason is not None:
            state.finished, state.finish_reason = True, out.finish_reason.value
            if out.timings is not None:
                self._timings.append((out.timings, time.monotonic()))
        if p not in self._prompt_tokens:
            self._prompt_tokens[p] = out.num_prompt_tokens
            self._cached_tokens[p] = out.num_cached_tokens
            self.metrics.prompt_tokens.inc(out.num_prompt_tokens)
        if ntok:
            now = time.monotonic()
            self._completion_tokens += ntok
            self.metrics.generation_tokens.inc(ntok)
            if self._first_token_time is None:
                self._first_token_time = now
                self.metrics.time_to_first_token.observe(now - self.arrival)
            if state.last_token_time is not None:
                self.metrics.inter_token_latency.observe((now - state.last_token_time) / ntok)
            state.last_token_time = now
        if out.request_finished:
            self._check_all_finished(p)

    def _check_all_finished(self, p: int) -> None:
        for seq in range(self.params.n):
            if not self._seqs[(p, seq)].finished:
                raise self._violation(p, seq, "the engine request ended before the sequence finished")
