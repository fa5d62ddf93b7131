"""What the completions and chat chunk streams share: a plan's engine run, engine errors that name the
user's field, priming (the first chunk awaited before the HTTP status is sent) and vLLM's prompt fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from pydantic import MISSING

from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import InvalidRequest
from openai_frontend.generation import Generation, Usage
from openai_frontend.logprobs import prompt_logprobs
from openai_frontend.metrics import Metrics
from openai_frontend.plans import GenerationPlan
from openai_frontend.request_log import current_request
from openai_frontend.responses import UsageInfo, VllmPromptLogprobs
from protocol import StepOutput

T = TypeVar("T")


def generation(engine: EngineClient, metrics: Metrics, plan: GenerationPlan) -> Generation:
    return Generation(
        engine,
        plan.model,
        plan.prompts,
        plan.params,
        plan.engine_request_id,
        metrics,
        plan.arrival,
        current_request.get(),
    )


async def named_errors(
    events: AsyncIterator[tuple[int, StepOutput]], plan: GenerationPlan
) -> AsyncIterator[tuple[int, StepOutput]]:
    """The engine's events; an engine refusal of the constraint names the user's field (constraints.py)."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except InvalidRequest as e:
        if plan.constraint is None:
            raise
        raise plan.constraint.rename(e) from None


async def primed(chunks: AsyncIterator[T]) -> AsyncIterator[T]:
    """Await the first chunk now (errors surface as exceptions here), then replay it and the rest."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise

    async def replay() -> AsyncIterator[T]:
        async with aclosing(chunks):
            if first is not None:
                yield first
            async for chunk in chunks:
                yield chunk

    return replay()


def usage_field(usage: Usage | None, plan: GenerationPlan) -> UsageInfo | None | MISSING:
    """A chunk's usage: OpenAI's null on every chunk but the last where usage is asked for, else left out."""
    if usage is not None:
        return UsageInfo.of(usage)
    return None if plan.include_usage else MISSING


def prompt_ids_field(plan: GenerationPlan, prompt_index: int) -> list[int] | MISSING:
    """vLLM's prompt_token_ids of a prompt (with return_token_ids its prompts went as ids)."""
    return list(plan.prompts[prompt_index]) if plan.return_token_ids else MISSING


def prompt_logprobs_field(plan: GenerationPlan, out: StepOutput) -> VllmPromptLogprobs | None | MISSING:
    """vLLM's prompt_logprobs: left out unless asked for; null where the engine sent none."""
    if plan.show_prompt_logprobs is None:
        return MISSING
    pl = out.prompt_logprobs
    return prompt_logprobs(pl, plan.show_prompt_logprobs, plan.tokens_as_ids) if pl else None
