"""FakeEngineClient: an EngineClient that replays scripted StepOutputs (the frontend tests, no Triton).

A script maps (prompt, params) to the items of one engine request, in order: a StepOutput is
yielded (with the caller's request id), an Exception is raised, a float is an `asyncio.sleep`. An
embedding request (Task.EMBED) plays `embed_script(prompt)` instead (default: `embedding_steps`).
`scripted_steps` builds well-formed StepOutputs (one token per step, interleaved sequences) that
keep every invariant, so a test breaks exactly the one it is about.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import EngineUnavailable, ModelNotFound
from protocol import AdmissionGroup, FinishReason, RequestTimings, SamplingParams, StepOutput, Task, TokenLogprobs

ScriptItem = StepOutput | Exception | float
Script = Callable[[str | list[int], SamplingParams], Sequence[ScriptItem]]
EmbedScript = Callable[[str | list[int]], Sequence[ScriptItem]]
FAKE_HIDDEN_SIZE = 8
# The engine timings on each sequence's last message (binary fractions: exact on the wire).
FAKE_TIMINGS = RequestTimings(queued_s=0.25, prefill_s=0.125, decode_s=0.5)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"  # noqa: E501
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FAKE_MODEL = ModelInfo(
    "fake-llm", chat_template=CHATML_TEMPLATE, bos_token="", eos_token="<|im_end|>", max_model_len=2048
)


def token_id(text: str) -> int:
    """A stable fake token id for a token text."""
    return sum(text.encode("utf-8")) % 1000 + 7


def scripted_steps(
    seq_tokens: Sequence[Sequence[str]],
    finish: Sequence[FinishReason | str] | FinishReason | str = "length",
    *,
    prompt_tokens: int = 5,
    cached_tokens: int = 0,
    logprobs: int | None = None,
    stop_reason: str | int | None = None,
    request_id: str = "fake",
    timings: RequestTimings | None = FAKE_TIMINGS,
) -> list[StepOutput]:
    """StepOutputs of n sequences (one per list of token texts), one token per step, interleaved by
    step; each sequence's last step carries its finish reason and `timings`, the very last one
    `request_finished`."""
    finishes = [finish] * len(seq_tokens) if isinstance(finish, (str, FinishReason)) else list(finish)
    steps: list[StepOutput] = []
    for step in range(max(len(t) for t in seq_tokens)):
        for seq, tokens in enumerate(seq_tokens):
            if step >= len(tokens):
                continue
            last = step == len(tokens) - 1
            reason = FinishReason(finishes[seq]) if last else None
            text = tokens[step]
            lp = None
            if logprobs is not None:
                alts = [f"{text}~{j}" for j in range(logprobs)]
                lp = TokenLogprobs(
                    logprobs=(-0.5,),
                    token_texts=(text,),
                    top_token_ids=(tuple(token_id(a) for a in alts),),
                    top_logprobs=(tuple(-1.0 - j for j in range(logprobs)),),
                    top_token_texts=(tuple(alts),),
                )
            steps.append(
                StepOutput(
                    request_id=request_id,
                    seq_index=seq,
                    step=step,
                    token_ids=(token_id(text),),
                    text_delta=text,
                    logprobs=lp,
                    finish_reason=reason,
                    stop_reason=stop_reason if reason == FinishReason.STOP else None,
                    num_prompt_tokens=prompt_tokens,
                    num_output_tokens=step + 1,
                    num_cached_tokens=cached_tokens,
                    timings=timings if last else None,
                )
            )
    steps[-1] = dataclasses.replace(steps[-1], request_finished=True)
    return steps


def default_script(prompt: str | list[int], params: SamplingParams) -> list[ScriptItem]:
    """n sequences of `max_tokens` (3 when unbounded) tokens "t0 " "t1 " ..., finishing with "length"."""
    length = params.max_tokens or 3
    prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt.split()))
    seqs = [[f"s{seq}t{i} " for i in range(length)] for seq in range(params.n)]
    return list(scripted_steps(seqs, "length", prompt_tokens=prompt_tokens, logprobs=params.logprobs))


def fake_embedding(prompt: str | list[int], size: int = FAKE_HIDDEN_SIZE) -> tuple[float, ...]:
    """A stable unit vector of `size` for a prompt (its values depend on the prompt's text or ids)."""
    seed = sum(prompt.encode("utf-8")) if isinstance(prompt, str) else sum(prompt)
    raw = [float((seed * (i + 3)) % 17 + 1) for i in range(size)]
    norm = sum(x * x for x in raw) ** 0.5
    return tuple(x / norm for x in raw)


def embedding_steps(prompt: str | list[int]) -> list[ScriptItem]:
    """The one StepOutput of an embedding request, as the engine sends it."""
    prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt.split()))
    return [
        StepOutput(
            request_id="fake",
            seq_index=0,
            step=0,
            token_ids=(),
            text_delta="",
            logprobs=None,
            finish_reason=FinishReason.STOP,
            stop_reason=None,
            num_prompt_tokens=prompt_tokens,
            num_output_tokens=0,
            request_finished=True,
            embedding=fake_embedding(prompt),
            timings=RequestTimings(queued_s=0.25, prefill_s=0.125, decode_s=0.0),
        )
    ]


@dataclass(frozen=True, slots=True)
class GenerateCall:
    model: str
    prompt: str | list[int]
    params: SamplingParams
    request_id: str
    admission_group: AdmissionGroup | None = None
    task: Task = Task.GENERATE
    headers: Mapping[str, str] | None = None


class FakeEngineClient:
    def __init__(
        self,
        script: Script = default_script,
        models: Sequence[ModelInfo] = (FAKE_MODEL,),
        *,
        available: bool = True,
        embed_script: EmbedScript = embedding_steps,
    ) -> None:
        self.script = script
        self.embed_script = embed_script
        self.models = {m.name: m for m in models}
        self.available = available
        self.calls: list[GenerateCall] = []
        self.cancelled: list[str] = []  # request ids whose stream was closed before its sequences finished
        self.closed = False
        self._aborting: str | None = None
        self._open = 0

    def _check_available(self) -> None:
        if not self.available:
            raise EngineUnavailable("Triton at fake:8001 is not available: connection refused")

    async def ready(self) -> bool:
        return self.available and bool(self.models)

    async def list_models(self) -> list[ModelInfo]:
        self._check_available()
        return sorted(self.models.values(), key=lambda m: m.name)

    async def model_config(self, model: str) -> ModelInfo:
        self._check_available()
        if model not in self.models:
            raise ModelNotFound(model)
        return self.models[model]

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        admission_group: AdmissionGroup | None = None,
        task: Task = Task.GENERATE,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StepOutput]:
        self._check_available()
        self.calls.append(GenerateCall(model, prompt, params, request_id, admission_group, task, headers))
        items = self.embed_script(prompt) if task is Task.EMBED else self.script(prompt, params)
        finished: set[int] = set()
        done = False
        self._open += 1
        try:
            for item in items:
                if self._aborting is not None:
                    raise EngineUnavailable(self._aborting)
                if isinstance(item, Exception):
                    done = True
                    raise item
                if isinstance(item, (int, float)):
                    await asyncio.sleep(item)
                    continue
                if item.finish_reason is not None:
                    finished.add(item.seq_index)
                yield dataclasses.replace(item, request_id=request_id)
            done = True
        finally:
            self._open -= 1
            if not done and len(finished) < params.n:
                self.cancelled.append(request_id)

    def abort_all(self, reason: str) -> int:
        self._aborting = reason  # each open stream raises at its next item
        return self._open

    async def close(self) -> None:
        self.closed = True
