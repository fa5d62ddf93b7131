"""POST /v1/completions' service: a CompletionRequest -> a CompletionPlan -> one chunk per engine step
(one choice, `index` = prompt_index * n + seq_index), or those chunks merged into one response."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import MISSING

from openai_frontend.constraints import request_constraint
from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import InvalidRequest
from openai_frontend.generation import Generation, Usage
from openai_frontend.logprobs import completion_logprobs, echo_logprobs, no_completion_logprobs
from openai_frontend.merge import merge_completion
from openai_frontend.metrics import Metrics
from openai_frontend.plans import (
    CompletionPlan,
    Prompt,
    engine_prompt,
    engine_prompts,
    kept_prompt_tokens,
    sampling_params,
    usage_options,
)
from openai_frontend.responses import CompletionResponse, CompletionResponseStreamChoice, CompletionStreamResponse
from openai_frontend.schemas import CompletionRequest
from openai_frontend.settings import Settings
from openai_frontend.streams import (
    generation,
    named_errors,
    primed,
    prompt_ids_field,
    prompt_logprobs_field,
    usage_field,
)
from openai_frontend.tokenizers import Tokenizers
from tokenization.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class CompletionService:
    engine: EngineClient
    settings: Settings
    metrics: Metrics
    tokenizers: Tokenizers

    async def stream(self, req: CompletionRequest) -> AsyncIterator[CompletionStreamResponse]:
        """The chunks of a streaming completion. Awaits the first one before returning, so a
        request the engine refuses still gets its HTTP error status."""
        plan = await self.plan(req)
        return await primed(self._chunks(plan))

    async def response(self, req: CompletionRequest) -> CompletionResponse:
        plan = await self.plan(req, force_usage=True)
        merged = await merge_completion(self._chunks(plan))
        return CompletionResponse(
            id=plan.request_id, created=plan.created, model=plan.model, choices=merged.choices, usage=merged.usage
        )

    async def plan(self, req: CompletionRequest, force_usage: bool = False) -> CompletionPlan:
        arrival = time.monotonic()
        limit = self.settings.max_prompts_per_request
        many = not isinstance(req.prompt, str) and bool(req.prompt) and not isinstance(req.prompt[0], int)
        if many and len(req.prompt) > limit:  # (a list of token ids is one prompt)
            raise InvalidRequest(f"prompt holds at most {limit} prompts (got {len(req.prompt)})", "prompt")
        if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
            raise InvalidRequest("best_of is only supported equal to n", "best_of")
        prompts = engine_prompts(req.prompt, "prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else self.settings.default_max_tokens
        if max_tokens < 0 or (max_tokens == 0 and not req.echo):
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only with echo: the prompt is scored, nothing generated)",
                "max_tokens",
            )
        echo_lps = req.logprobs if req.echo else None
        constraint = request_constraint(req)
        # vLLM's rules: echo with logprobs k scores the prompt with k alternatives unless prompt_logprobs says
        # otherwise; max_tokens 0 runs one step and shows none of it.
        scored = max(k for k in (req.prompt_logprobs, echo_lps, -1) if k is not None)
        params = sampling_params(
            req,
            max_tokens=max(max_tokens, 1),
            logprobs=req.logprobs,
            constraint=constraint,
            prompt_logprobs=scored if scored >= 0 else None,
        )
        usage = usage_options(req, force_usage)
        model = await self.engine.model_config(req.model)  # ModelNotFound -> 404 before any work
        keep = kept_prompt_tokens(req, model)
        # The frontend's tokenizer is needed to show token-id prompts as text, and to send text prompts as ids.
        echo_ids = bool(req.echo) and any(not isinstance(p, str) for p in prompts)
        needs_tokenizer = echo_ids or req.return_token_ids or keep is not None
        echo_texts = tuple(p for p in prompts if isinstance(p, str)) if req.echo else None  # (all text here)
        if needs_tokenizer:
            tokenizer = await self.tokenizers.get(model)
            chars = sum(len(p) for p in prompts)
            prompts, echo_texts = await self.tokenizers.run(
                chars, _engine_prompts, prompts, tokenizer, keep, bool(req.echo), bool(req.return_token_ids)
            )
        return CompletionPlan.of(
            req,
            model=model,
            id_prefix="cmpl",
            prompts=prompts,
            params=params,
            arrival=arrival,
            constraint=constraint,
            usage=usage,
            echo_texts=echo_texts,
            echo_logprobs=echo_lps,
            echo_only=bool(req.echo) and max_tokens == 0,
        )

    async def _chunks(self, plan: CompletionPlan) -> AsyncIterator[CompletionStreamResponse]:
        gen = generation(self.engine, self.metrics, plan)
        n = plan.params.n
        offsets: dict[int, int] = {}  # per choice: characters of logprob tokens so far (text_offset)
        async with aclosing(named_errors(gen.events(), plan)) as events:
            async for p, out in events:
                index = p * n + out.seq_index
                first = index not in offsets
                text = "" if plan.echo_only else out.text_delta
                logprobs = None
                if first and plan.echo_texts is not None:
                    text = plan.echo_texts[p] + text
                    if plan.echo_logprobs is not None and out.prompt_logprobs is not None:
                        logprobs = echo_logprobs(out.prompt_logprobs, plan.echo_logprobs, plan.tokens_as_ids)
                        offsets[index] = sum(len(t) for t in out.prompt_logprobs.token_texts)
                offset = offsets.setdefault(index, 0)
                if plan.params.logprobs is not None:
                    generated = (
                        no_completion_logprobs()
                        if plan.echo_only
                        else completion_logprobs(out, offset, plan.tokens_as_ids)
                    )
                    if logprobs is None:
                        logprobs = generated
                    else:
                        logprobs.extend(generated)
                    if out.logprobs is not None and not plan.echo_only:
                        offsets[index] = offset + sum(len(t) for t in out.logprobs.token_texts)
                finish = out.finish_reason.value if out.finish_reason else None
                choice = CompletionResponseStreamChoice(
                    index=index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=finish,
                    stop_reason=out.stop_reason if finish else None,
                    token_ids=([] if plan.echo_only else list(out.token_ids)) if plan.return_token_ids else MISSING,
                    prompt_token_ids=prompt_ids_field(plan, p) if first else MISSING,
                    prompt_logprobs=prompt_logprobs_field(plan, out) if first else MISSING,
                )
                yield self._chunk(plan, [choice], self._usage(gen, plan) if plan.continuous_usage else None)
        if plan.include_usage:
            yield self._chunk(plan, [], self._usage(gen, plan))

    @staticmethod
    def _chunk(
        plan: CompletionPlan, choices: list[CompletionResponseStreamChoice], usage: Usage | None
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=plan.request_id, created=plan.created, model=plan.model, choices=choices, usage=usage_field(usage, plan)
        )

    @staticmethod
    def _usage(gen: Generation, plan: CompletionPlan) -> Usage:
        """Usage counts what the response shows: echo with max_tokens 0 completes no token."""
        return gen.usage.without_completion() if plan.echo_only else gen.usage


def _engine_prompts(
    prompts: tuple[Prompt, ...], tokenizer: Tokenizer, keep: int | None, echo: bool, as_ids: bool
) -> tuple[tuple[Prompt, ...], tuple[str, ...] | None]:
    """The prompts the engine is sent (plans.engine_prompt) and, with echo, the text each choice starts with."""
    if keep is not None:  # a prompt that is cut goes as the ids kept, and echo shows their text
        prompts = tuple(engine_prompt(p, tokenizer.encode, keep, as_ids=False) for p in prompts)
    echo_texts = None
    if echo:
        echo_texts = tuple(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts)
    if as_ids:  # sent as ids, so the ids returned are the ones the engine ran
        prompts = tuple(engine_prompt(p, tokenizer.encode, None, as_ids=True) for p in prompts)
    return prompts, echo_texts
