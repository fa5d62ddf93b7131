"""POST /v1/embeddings' service: an EmbeddingRequest -> one prompt-only engine request per input
(Task.EMBED: the engine runs the prompt beside the generations, under the same token budget, and answers
with the final-norm hidden state of its last token, L2-normalised) -> one typed EmbeddingResponse.

The inputs of one request run together, as one admission group (the engine's queue bound admits them
whole or refuses them whole, as a completions batch). docs/embeddings.md.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Mapping
from contextlib import aclosing
from dataclasses import dataclass, field

import numpy as np

from openai_frontend.embedding_schemas import (
    EmbeddingData,
    EmbeddingInput,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import EngineFailure, FrontendError, InvalidRequest
from openai_frontend.metrics import Metrics
from openai_frontend.plans import engine_prompts
from openai_frontend.request_log import current_request, response_ids
from openai_frontend.settings import Settings
from protocol import AdmissionGroup, SamplingParams, StepOutput, Task

Prompt = str | list[int]
_NO_SAMPLING = SamplingParams()  # (an embedding request carries none: nothing is sampled)


@dataclass(frozen=True, slots=True)
class EmbeddingService:
    engine: EngineClient
    settings: Settings
    metrics: Metrics
    # Each model's vector size, once one of its vectors was seen: a `dimensions` that differs is then
    # refused before any engine work (before that, once the vectors are back).
    _sizes: dict[str, int] = field(default_factory=dict)

    async def response(self, req: EmbeddingRequest) -> EmbeddingResponse:
        arrival = time.monotonic()
        prompts = self._prompts(req.input)
        if req.dimensions is not None and req.dimensions < 1:
            raise InvalidRequest("dimensions must be at least 1", "dimensions")
        model = await self.engine.model_config(req.model)  # ModelNotFound -> 404 before any work
        if req.dimensions is not None and model.name in self._sizes:
            _check_dimensions(req.dimensions, self._sizes[model.name], model.name)
        response_id, engine_request_id = response_ids("embd")
        group = AdmissionGroup(engine_request_id, len(prompts)) if len(prompts) > 1 else None
        record = current_request.get()
        headers = None if record is None else record.trace_headers
        outs = await self._embed_all(model.name, prompts, engine_request_id, group, headers)
        received_at = time.monotonic()
        self.metrics.e2e_request_latency.observe(received_at - arrival)
        size = len(outs[0].embedding or ())
        self._sizes[model.name] = size
        if req.dimensions is not None:
            _check_dimensions(req.dimensions, size, model.name)
        tokens = sum(out.num_prompt_tokens for out in outs)
        self.metrics.prompt_tokens.inc(tokens)
        self.metrics.embedding_inputs.inc(len(outs))
        if record is not None:  # the access log line's numbers (request_log.py)
            record.generated = True
            record.model = model.name
            for out in outs:
                if out.timings is not None:
                    record.add_engine_timings(out.timings, received_at)
            record.prompt_tokens += tokens
            record.cached_tokens += sum(out.num_cached_tokens for out in outs)
            record.finish_reasons += [out.finish_reason.value for out in outs if out.finish_reason is not None]
        return EmbeddingResponse(
            id=response_id,
            created=int(time.time()),
            model=model.name,
            data=[
                EmbeddingData(index=i, embedding=_encoded(out.embedding or (), req.encoding_format))
                for i, out in enumerate(outs)
            ],
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    def _prompts(self, value: EmbeddingInput) -> list[Prompt]:
        """The engine prompts of `input` (completions' rules: a list of ints is one prompt of token ids)."""
        prompts: list[Prompt] = [p if isinstance(p, str) else list(p) for p in engine_prompts(value, "input")]
        limit = self.settings.max_prompts_per_request
        if len(prompts) > limit:
            raise InvalidRequest(f"input holds at most {limit} inputs (got {len(prompts)})", "input")
        if any(not p for p in prompts):
            raise InvalidRequest("an input must not be empty", "input")
        return prompts

    async def _embed_all(
        self,
        model: str,
        prompts: list[Prompt],
        request_id: str,
        group: AdmissionGroup | None,
        headers: Mapping[str, str] | None,
    ) -> list[StepOutput]:
        try:
            if len(prompts) == 1:
                return [await self._embed(model, prompts[0], f"{request_id}-0", group, headers)]
            async with asyncio.TaskGroup() as tasks:  # the first failure cancels the others
                running = [
                    tasks.create_task(self._embed(model, p, f"{request_id}-{i}", group, headers))
                    for i, p in enumerate(prompts)
                ]
        except* FrontendError as group_error:
            raise _named(group_error.exceptions[0]) from None
        return [task.result() for task in running]

    async def _embed(
        self,
        model: str,
        prompt: Prompt,
        request_id: str,
        group: AdmissionGroup | None,
        headers: Mapping[str, str] | None,
    ) -> StepOutput:
        """One input's engine request: its one message, which carries the vector."""
        try:
            stream = self.engine.generate(
                model, prompt, _NO_SAMPLING, request_id, group, task=Task.EMBED, headers=headers
            )
            async with aclosing(stream):
                async for out in stream:
                    if out.embedding is None or not out.finished:
                        raise EngineFailure("the engine answered an embedding request without its vector")
                    return out
        except FrontendError as e:
            raise _named(e) from None
        except Exception as e:  # noqa: BLE001 - a bug in a client must end the request, not hang it
            raise EngineFailure(f"engine client failed: {type(e).__name__}: {e}") from None
        raise EngineFailure("the engine ended an embedding request without its vector")


def _named(error: FrontendError) -> FrontendError:
    """The engine's refusal of a prompt names the request's own field, `input`."""
    if isinstance(error, InvalidRequest) and error.param == "prompt":
        return InvalidRequest(error.message.replace("prompt", "input"), "input", error.code)
    return error


def _check_dimensions(dimensions: int, size: int, model: str) -> None:
    """vLLM's refusal for a model not trained for shortened (matryoshka) vectors; its own size is no change."""
    if dimensions != size:
        raise InvalidRequest(
            f'Model "{model}" does not support matryoshka representation, changing output dimensions will lead '
            f"to poor results (its embeddings have {size} dimensions; dimensions must be {size} or left out).",
            "dimensions",
        )


def _encoded(vector: tuple[float, ...], encoding_format: str) -> list[float] | str:
    """OpenAI's (and vLLM's) two forms: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)
