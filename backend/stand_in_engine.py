"""A model-free engine with LLMEngine's interface, for measuring the response path (`make bench-wire`).

Every step gives each running sequence one token (the same short word) after a fixed step time, the
way a GPU engine at a large batch would, so the Triton model's sender, tritonserver's gRPC streams and
the frontend carry a chosen response rate with no model in the way. The Triton model runs it instead
of LLMEngine when its parameter `engine` is "stand-in" (benchmarks/wire_bench.py sets that, with
`stand_in_step_ms` and `max_num_seqs`). Messages follow docs/contract.md like the real engine's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backend.engine import EngineStats
from protocol import (
    AdmissionGroup,
    EngineOutput,
    FinishReason,
    GenerateRequest,
    InvalidRequestError,
    RequestTimings,
    SamplingParams,
    StepOutput,
    Task,
)

TOKEN_ID = 253  # any id; the text below is what clients see
TOKEN_TEXT = " x"


@dataclass(slots=True)
class _Request:
    request: GenerateRequest
    produced: list[int] = field(default_factory=list)  # tokens so far, per sequence
    finished: int = 0  # sequences done
    submitted_at: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0  # (its first step also gives its first tokens)

    def timings(self, finished_at: float) -> RequestTimings:
        return RequestTimings(self.scheduled_at - self.submitted_at, 0.0, finished_at - self.scheduled_at)


class StandInEngine:
    def __init__(self, step_ms: float, max_num_seqs: int, max_tokens: int = 4096) -> None:
        self.step_s = step_ms / 1e3
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max_tokens  # for requests that leave max_tokens unset
        self._running: dict[str, _Request] = {}
        self._waiting: list[_Request] = []
        self._next_step_at = 0.0
        self._tokens = 0
        self._aborted: list[str] = []

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, task: Task = Task.GENERATE
    ) -> GenerateRequest:
        if task is not Task.GENERATE:
            raise InvalidRequestError("the stand-in engine only generates", "task")
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        ids = tuple(range(len(prompt.split()))) if isinstance(prompt, str) else tuple(prompt)
        return GenerateRequest(request_id, ids or (0,), params)

    def add_request(self, request: GenerateRequest, admission_group: AdmissionGroup | None = None) -> None:
        """(No queue bound here, so `admission_group` changes nothing.)"""
        if request.request_id in self._running or any(
            w.request.request_id == request.request_id for w in self._waiting
        ):
            raise InvalidRequestError(f"request id {request.request_id!r} is already running", "request_id")
        self._waiting.append(_Request(request, [0] * request.params.n))

    def abort_request(self, request_id: str) -> None:
        self._waiting = [w for w in self._waiting if w.request.request_id != request_id]
        if request_id in self._running:
            self._aborted.append(request_id)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[EngineOutput]:
        while self._waiting and self._seqs_running() + self._waiting[0].request.params.n <= self.max_num_seqs:
            r = self._waiting.pop(0)
            r.scheduled_at = time.monotonic()
            self._running[r.request.request_id] = r
        wait = self._next_step_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)  # the step's compute: the GIL is free meanwhile, as during a GPU step
        self._next_step_at = max(self._next_step_at + self.step_s, time.perf_counter())
        outputs: list[EngineOutput] = []
        for request_id in list(self._running):
            outputs += self._advance(self._running[request_id], abort=request_id in self._aborted)
        self._aborted.clear()
        return outputs

    def _advance(self, r: _Request, abort: bool) -> list[StepOutput]:
        params, out = r.request.params, []
        limit = params.max_tokens or self.max_tokens
        now = None
        for seq, produced in enumerate(r.produced):
            if produced < 0:  # this sequence finished earlier
                continue
            done = abort or produced + 1 >= limit
            r.finished += done
            last = r.finished == len(r.produced)
            if done and now is None:
                now = time.monotonic()
            out.append(
                StepOutput(
                    request_id=r.request.request_id,
                    seq_index=seq,
                    step=produced,
                    token_ids=() if abort else (TOKEN_ID,),
                    text_delta="" if abort else TOKEN_TEXT,
                    logprobs=None,
                    finish_reason=(FinishReason.ABORT if abort else FinishReason.LENGTH) if done else None,
                    stop_reason=None,
                    num_prompt_tokens=len(r.request.prompt_token_ids),
                    num_output_tokens=produced + (not abort),
                    request_finished=last,
                    timings=r.timings(now) if done else None,
                )
            )
            self._tokens += not abort
            r.produced[seq] = -1 if done else produced + 1
        if r.finished == len(r.produced):
            del self._running[r.request.request_id]
        return out

    def _seqs_running(self) -> int:
        return sum(len(r.produced) - r.finished for r in self._running.values())

    def close(self) -> None:
        """Nothing to end: LLMEngine's interface."""

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self._seqs_running(),
            num_waiting=sum(len(w.produced) for w in self._waiting),
            kv_blocks_total=0,  # no KV cache
            kv_blocks_used=0,
            kv_blocks_free=0,
            kv_blocks_cached=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=self._tokens,
            aborted_requests=0,
            rejected_requests=0,
        )
