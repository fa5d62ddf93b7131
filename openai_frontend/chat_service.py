"""POST /v1/chat/completions' service: a ChatCompletionRequest -> a ChatPlan (template, tools, constraint)
-> one chunk per engine step (a role chunk first per choice, tool calls read from the text), or those
chunks merged into one response."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from pydantic import MISSING

from openai_frontend.chat_prompt import ChatInput, rendered_chat
from openai_frontend.constraints import request_constraint, tool_call_constraint
from openai_frontend.engine_client import EngineClient, ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.generation import Usage
from openai_frontend.logprobs import chat_logprobs
from openai_frontend.merge import given, merge_chat
from openai_frontend.metrics import Metrics
from openai_frontend.plans import ChatPlan, Prompt, engine_prompt, kept_prompt_tokens, sampling_params, usage_options
from openai_frontend.responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    Finish,
    StopReason,
    VllmPromptLogprobs,
)
from openai_frontend.schemas import ChatCompletionRequest, ChatMessage
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
from openai_frontend.tool_calls import ToolCallStream, forced_call_schema, tool_plan
from protocol import StepOutput
from tokenization.tokenizer import Tokenizer

_ROLE = DeltaMessage(role="assistant", content="")
_NO_DELTA = DeltaMessage()


def _chat_prompt(
    model: ModelInfo,
    chat: ChatInput,
    tokenizer: Tokenizer | None,
    special_texts: frozenset[str],
    keep: int | None,
    as_ids: bool,
) -> Prompt:
    """What the engine is sent for `chat` (plans.engine_prompt): as ids where a user string holds one of
    `special_texts`, so that it stays text (chat_prompt.py)."""
    rendered = rendered_chat(model, chat, special_texts)
    if tokenizer is None:
        return rendered.text
    encode = functools.partial(tokenizer.encode_with_text_spans, text_spans=rendered.text_spans)
    return engine_prompt(rendered.text, encode, keep, as_ids or bool(rendered.text_spans))


def _chat_prompts(
    model: ModelInfo,
    chats: list[ChatInput],
    tokenizer: Tokenizer | None,
    special_texts: frozenset[str],
    keep: int | None,
    as_ids: bool,
) -> tuple[Prompt, ...]:
    """Each conversation's prompt, in one piece of prompt work (one thread hop for a whole batch)."""
    return tuple(_chat_prompt(model, chat, tokenizer, special_texts, keep, as_ids) for chat in chats)


async def _batch_errors(events: AsyncIterator[tuple[int, StepOutput]]) -> AsyncIterator[tuple[int, StepOutput]]:
    """A batched chat's engine events: the engine's `prompt` is this request's `messages`: `prompt.<i>`
    (conversation i refused, e.g. past the context window) is `messages.<i>`, `prompt` (the batch's
    sequences could never fit the queue) is `messages`."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except InvalidRequest as e:
        if e.param == "prompt" or (e.param or "").startswith("prompt."):
            e.param = "messages" + e.param.removeprefix("prompt")
        raise


@dataclass(frozen=True, slots=True)
class ChatService:
    engine: EngineClient
    settings: Settings
    metrics: Metrics
    tokenizers: Tokenizers

    async def stream(self, req: ChatCompletionRequest) -> AsyncIterator[ChatCompletionStreamResponse]:
        """The chunks of a streaming chat completion (the first one awaited, as in completions)."""
        plan = await self.plan(req)
        return await primed(self._chunks(plan))

    async def response(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        plan = await self.plan(req, force_usage=True)
        merged = await merge_chat(self._chunks(plan))
        first = merged.first
        return ChatCompletionResponse(
            id=plan.request_id,
            created=plan.created,
            model=plan.model,
            choices=merged.choices,
            usage=merged.usage,
            prompt_token_ids=None if first is None else given(first.prompt_token_ids),
            prompt_logprobs=None if first is None else given(first.prompt_logprobs),
        )

    async def plan(self, req: ChatCompletionRequest, force_usage: bool = False) -> ChatPlan:
        arrival = time.monotonic()
        if (
            req.max_tokens is not None
            and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens
        ):
            raise InvalidRequest("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        given = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self.settings.chat_default_max_tokens
        elif max_tokens < 1:
            raise InvalidRequest(f"{given} must be at least 1", given)
        top = req.top_logprobs or 0
        try:
            tools = tool_plan(req)
        except LookupError as e:
            raise InvalidRequest(str(e), "tool_choice") from None
        constraint = request_constraint(req)
        forced = forced_call_schema(tools)
        if forced is not None:
            if constraint is not None:
                raise InvalidRequest(
                    f"tool_choice {tools.mode!r} cannot be combined with {constraint.param}", constraint.param
                )
            constraint = tool_call_constraint(forced, "tools")
        params = sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=top if req.logprobs else None,
            constraint=constraint,
            prompt_logprobs=req.prompt_logprobs,
        )
        usage = usage_options(req, force_usage)
        conversations = req.conversations()
        if req.batched:
            _check_batch(req, len(conversations), self.settings.max_prompts_per_request)
        model = await self.engine.model_config(req.model)
        keep = kept_prompt_tokens(req, model)
        as_ids = bool(req.return_token_ids)
        tokenizer, special_texts = await self.tokenizers.for_chat(model, needed=as_ids or keep is not None)
        chats = [
            ChatInput(
                messages,
                tools,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                f"messages.{i}" if req.batched else "messages",
            )
            for i, messages in enumerate(conversations)
        ]
        prompts = await self.tokenizers.run(
            sum(chat.work_chars() for chat in chats),
            _chat_prompts,
            model,
            chats,
            tokenizer,
            special_texts,
            keep,
            as_ids,
        )
        return ChatPlan.of(
            req,
            model=model,
            id_prefix="chatcmpl",
            prompts=prompts,
            params=params,
            arrival=arrival,
            constraint=constraint,
            usage=usage,
            top_logprobs=top,
            tools=tools,
            echo=tuple(_echo(req, messages) for messages in conversations),
            batch=req.batched,
        )

    async def _chunks(self, plan: ChatPlan) -> AsyncIterator[ChatCompletionStreamResponse]:
        gen = generation(self.engine, self.metrics, plan)
        n = plan.params.n
        choices = len(plan.prompts) * n
        first = True
        tool_streams: dict[int, ToolCallStream] = {}
        named = named_errors(gen.events(), plan)
        async with aclosing(_batch_errors(named) if plan.batch else named) as events:
            async for p, out in events:
                index = p * n + out.seq_index
                if first:  # the role goes first, once per choice (after the engine accepted the request)
                    first = False
                    usage = gen.usage.without_completion() if plan.continuous_usage else None
                    # vLLM's response-level fields travel on the first chunk (a batch has none: they would
                    # describe one of its conversations).
                    yield self._chunk(
                        plan,
                        usage,
                        0,
                        _ROLE,
                        prompt_token_ids=MISSING if plan.batch else prompt_ids_field(plan, p),
                        prompt_logprobs=prompt_logprobs_field(plan, out),
                    )
                    for i in range(1, choices):
                        yield self._chunk(plan, usage, i, _ROLE)
                    for i in range(choices):
                        echo = plan.echo[i // n]
                        if echo:
                            yield self._chunk(plan, usage, i, DeltaMessage(content=echo))
                logprobs = (
                    chat_logprobs(out, plan.top_logprobs, plan.tokens_as_ids)
                    if plan.params.logprobs is not None
                    else None
                )
                finish = out.finish_reason.value if out.finish_reason else None
                if plan.tools.active:
                    stream = tool_streams.setdefault(index, ToolCallStream(plan.tools))
                    raw = stream.feed(out.text_delta) + (stream.finish() if finish else [])
                    deltas = [DeltaMessage.model_validate(delta) for delta in raw]
                    if finish == "stop" and stream.called and plan.tools.mode != "named":
                        finish = "tool_calls"
                else:
                    deltas = [DeltaMessage(content=out.text_delta)]
                usage = gen.usage if plan.continuous_usage else None
                for delta in deltas[:-1]:
                    yield self._chunk(plan, usage, index, delta)
                if deltas or logprobs is not None or finish or plan.return_token_ids:
                    yield self._chunk(
                        plan,
                        usage,
                        index,
                        deltas[-1] if deltas else _NO_DELTA,
                        logprobs=logprobs,
                        finish_reason=finish,
                        stop_reason=out.stop_reason if finish else None,
                        token_ids=list(out.token_ids) if plan.return_token_ids else MISSING,
                    )
        if plan.include_usage:
            yield self._chunk(plan, gen.usage)

    @staticmethod
    def _chunk(
        plan: ChatPlan,
        usage: Usage | None,
        index: int | None = None,
        delta: DeltaMessage | None = None,
        *,
        logprobs: ChatCompletionLogProbs | None = None,
        finish_reason: Finish | None = None,
        stop_reason: StopReason = None,
        token_ids: list[int] | MISSING = MISSING,
        prompt_token_ids: list[int] | MISSING = MISSING,
        prompt_logprobs: VllmPromptLogprobs | None | MISSING = MISSING,
    ) -> ChatCompletionStreamResponse:
        """A chunk of one choice's delta, or (no delta) of the usage only."""
        choices = []
        if delta is not None:
            choice = ChatCompletionResponseStreamChoice(
                index=index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                token_ids=token_ids,
            )
            choices.append(choice)
        return ChatCompletionStreamResponse(
            id=plan.request_id,
            created=plan.created,
            model=plan.model,
            choices=choices,
            usage=usage_field(usage, plan),
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
        )


def _echo(req: ChatCompletionRequest, messages: list[ChatMessage]) -> str | None:
    """vLLM's echo: a conversation's last message, where it is the assistant's, starts its choices."""
    last = messages[-1]
    return last.text() if req.echo and last.role == "assistant" else None


def _check_batch(req: ChatCompletionRequest, conversations: int, limit: int) -> None:
    """What a batched chat refuses (vLLM's rules for its batches, and the bound of completions' prompts)."""
    if conversations > limit:
        raise InvalidRequest(f"messages holds at most {limit} conversations (got {conversations})", "messages")
    if req.stream:
        raise InvalidRequest("a batched chat (messages as a list of conversations) cannot be streamed", "stream")
    if req.n is not None and req.n != 1:
        raise InvalidRequest("a batched chat (messages as a list of conversations) takes only n = 1", "n")
    if req.prompt_logprobs is not None:
        # A chat's prompt_logprobs is a response-level field, which holds one conversation's.
        raise InvalidRequest(
            "prompt_logprobs are not available for a batched chat (messages as a list of conversations)",
            "prompt_logprobs",
        )
