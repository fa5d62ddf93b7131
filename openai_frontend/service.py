"""The service layer: an OpenAI request -> engine requests -> OpenAI chunks or one response.

Streaming and non-streaming share one path: `_*_chunks` turns each checked StepOutput into exactly
one chunk (one choice, `index` = prompt_index * n + seq_index), and the non-streaming response is
those same chunks merged. So both give the same text, tokens and logprobs by construction.
The chunks are plain JSON-ready dicts; SSE framing is the router's job.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from openai_frontend.chat_template import render_chat, template_reads_tools
from openai_frontend.constraints import Constraint, request_constraint, tool_call_constraint
from openai_frontend.engine_client import EngineClient, ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.generation import Generation, Usage
from openai_frontend.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, prompt_logprobs
from openai_frontend.metrics import Metrics
from openai_frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from openai_frontend.settings import Settings
from openai_frontend.tokenizers import Tokenizers
from openai_frontend.tool_calls import (
    ToolCallStream,
    ToolPlan,
    forced_call_schema,
    template_messages,
    template_tools,
    tool_plan,
)
from protocol import InvalidRequestError, SamplingParams, StepOutput


@dataclass(frozen=True, slots=True)
class _Plan:
    """A validated request, ready to run: what the service derived from the HTTP body."""

    request_id: str
    created: int
    model: str
    prompts: tuple[str | tuple[int, ...], ...]
    params: SamplingParams
    echo_texts: tuple[str, ...] | None  # completions echo: the text put before each prompt's choices
    include_usage: bool
    continuous_usage: bool
    top_logprobs: int  # chat: how many alternatives to show per token
    arrival: float
    constraint: Constraint | None = None  # the output constraint and the field it came from
    tools: ToolPlan = ToolPlan("none")  # chat: how the output's tool calls are read
    echo_logprobs: int | None = None  # completions echo with logprobs k: the prompt's logprobs lead each choice's
    echo_only: bool = False  # completions echo with max_tokens 0: the engine's one token is not shown
    show_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs k: the field in the response
    return_token_ids: bool = False  # prompts went as token ids; responses carry prompt_token_ids and token_ids
    tokens_as_ids: bool = False  # logprob tokens named `token_id:<id>`
    chat_echo: str | None = None  # chat echo: the last (assistant) message's content starts each choice


class Service:
    def __init__(self, engine: EngineClient, settings: Settings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics
        self.tokenizers = Tokenizers(settings.tokenizer)

    # -- completions -----------------------------------------------------------------------------

    async def completion_stream(self, req: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
        """The chunks of a streaming completion. Awaits the first one before returning, so a
        request the engine refuses still gets its HTTP error status."""
        plan = await self._completion_plan(req)
        return await _primed(self._completion_chunks(plan))

    async def completion(self, req: CompletionRequest) -> dict[str, Any]:
        plan = await self._completion_plan(req, force_usage=True)
        choices: dict[int, dict[str, Any]] = {}
        usage = None
        async with aclosing(self._completion_chunks(plan)) as chunks:
            async for chunk in chunks:
                usage = chunk.get("usage", usage)
                for c in chunk["choices"]:
                    acc = choices.setdefault(
                        c["index"],
                        {"index": c["index"], "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None},
                    )
                    acc["text"] += c["text"]
                    if c["logprobs"] is not None:
                        acc["logprobs"] = _extend_lists(acc["logprobs"], c["logprobs"])
                    acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c["stop_reason"]
                    _merge_token_fields(acc, c)
        return {
            "id": plan.request_id,
            "object": "text_completion",
            "created": plan.created,
            "model": plan.model,
            "choices": [choices[i] for i in sorted(choices)],
            "usage": usage,
        }

    async def _completion_plan(self, req: CompletionRequest, force_usage: bool = False) -> _Plan:
        arrival = time.monotonic()
        if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
            raise InvalidRequest("best_of is only supported equal to n", "best_of")
        prompts = _normalize_prompts(req.prompt)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.settings.default_max_tokens
        if max_tokens < 0 or (max_tokens == 0 and not req.echo):
            raise InvalidRequest(
                "max_tokens must be at least 1 (0 only with echo: the prompt is scored, nothing generated)",
                "max_tokens",
            )
        echo_logprobs = req.logprobs if req.echo else None
        constraint = request_constraint(req)
        # vLLM's rules: echo with logprobs k scores the prompt with k alternatives unless prompt_logprobs says
        # otherwise; max_tokens 0 runs one step and shows none of it.
        scored = max(k for k in (req.prompt_logprobs, echo_logprobs, -1) if k is not None)
        params = _sampling_params(
            req,
            max_tokens=max(max_tokens, 1),
            logprobs=req.logprobs,
            constraint=constraint,
            prompt_logprobs=scored if scored >= 0 else None,
        )
        include, continuous = _usage_options(req, force_usage)
        model = await self.engine.model_config(req.model)  # ModelNotFound -> 404 before any work
        keep = _kept_prompt_tokens(req, model)
        # The frontend's tokenizer is needed to show token-id prompts as text, and to send text prompts as ids.
        echo_ids = bool(req.echo) and any(not isinstance(p, str) for p in prompts)
        needs_tokenizer = echo_ids or req.return_token_ids or keep is not None
        tokenizer = await self.tokenizers.get(model) if needs_tokenizer else None
        if keep is not None:  # a prompt that is cut goes as the ids kept, and echo shows their text
            prompts = tuple(_engine_prompt(p, tokenizer.encode, keep, as_ids=False) for p in prompts)
        echo_texts = None
        if req.echo:
            echo_texts = tuple(
                p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts
            )
        if req.return_token_ids:  # sent as ids, so the ids returned are the ones the engine ran
            prompts = tuple(_engine_prompt(p, tokenizer.encode, None, as_ids=True) for p in prompts)
        return _Plan(
            f"cmpl-{uuid.uuid4().hex}",
            int(time.time()),
            req.model,
            prompts,
            params,
            echo_texts,
            include,
            continuous,
            0,
            arrival,
            constraint,
            echo_logprobs=echo_logprobs,
            echo_only=bool(req.echo) and max_tokens == 0,
            show_prompt_logprobs=req.prompt_logprobs,
            return_token_ids=bool(req.return_token_ids),
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
        )

    async def _completion_chunks(self, plan: _Plan) -> AsyncIterator[dict[str, Any]]:
        gen = Generation(
            self.engine, plan.model, plan.prompts, plan.params, plan.request_id, self.metrics, plan.arrival
        )
        n = plan.params.n
        offsets: dict[int, int] = {}  # per choice: characters of logprob tokens so far (text_offset)
        async with aclosing(_named_errors(gen.events(), plan)) as events:
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
                        _NO_COMPLETION_LOGPROBS
                        if plan.echo_only
                        else completion_logprobs(out, offset, plan.tokens_as_ids)
                    )
                    logprobs = _extend_lists(logprobs, generated)
                    if out.logprobs is not None and not plan.echo_only:
                        offsets[index] = offset + sum(len(t) for t in out.logprobs.token_texts)
                finish = out.finish_reason.value if out.finish_reason else None
                choice = {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": out.stop_reason if finish else None,
                }
                choice |= _token_fields(plan, p, out, first, in_choice=True)
                yield _chunk(
                    plan, "text_completion", [choice], self._usage(gen, plan) if plan.continuous_usage else None
                )
        if plan.include_usage:
            yield _chunk(plan, "text_completion", [], self._usage(gen, plan))

    @staticmethod
    def _usage(gen: Generation, plan: _Plan) -> Usage:
        """Usage counts what the response shows: echo with max_tokens 0 completes no token."""
        return Usage(gen.usage.prompt_tokens, 0) if plan.echo_only else gen.usage

    # -- chat completions ------------------------------------------------------------------------

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        plan = await self._chat_plan(req)
        return await _primed(self._chat_chunks(plan))

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        plan = await self._chat_plan(req, force_usage=True)
        choices: dict[int, dict[str, Any]] = {}
        usage = None
        top: dict[str, Any] = {}  # vLLM's response-level fields: prompt_token_ids, prompt_logprobs
        async with aclosing(self._chat_chunks(plan)) as chunks:
            async for chunk in chunks:
                usage = chunk.get("usage", usage)
                top |= {key: chunk[key] for key in _RESPONSE_FIELDS if key in chunk}
                for c in chunk["choices"]:
                    acc = choices.setdefault(
                        c["index"],
                        {
                            "index": c["index"],
                            "message": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        },
                    )
                    message = acc["message"]
                    message["content"] += c["delta"].get("content", "")
                    for call in c["delta"].get("tool_calls", ()):
                        _merge_tool_call(message.setdefault("tool_calls", []), call)
                    if c["logprobs"] is not None:
                        acc["logprobs"] = _extend_lists(acc["logprobs"], c["logprobs"])
                    if "role" not in c["delta"]:
                        acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c["stop_reason"]
                    _merge_token_fields(acc, c)
        for acc in choices.values():
            if acc["message"].get("tool_calls") and not acc["message"]["content"]:
                acc["message"]["content"] = None  # OpenAI: a message of calls only has no content
        return {
            "id": plan.request_id,
            "object": "chat.completion",
            "created": plan.created,
            "model": plan.model,
            "choices": [choices[i] for i in sorted(choices)],
            "usage": usage,
            **top,
        }

    async def _chat_plan(self, req: ChatCompletionRequest, force_usage: bool = False) -> _Plan:
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
        params = _sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=top if req.logprobs else None,
            constraint=constraint,
            prompt_logprobs=req.prompt_logprobs,
        )
        include, continuous = _usage_options(req, force_usage)
        model = await self.engine.model_config(req.model)
        knows_tools = bool(model.chat_template) and template_reads_tools(model.name, model.chat_template)
        messages = template_messages(req.messages, tools, knows_tools)
        prompt: str | tuple[int, ...] = render_chat(
            model,
            messages,
            template_tools(tools) if knows_tools else None,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            template_kwargs=req.chat_template_kwargs,
        )
        keep = _kept_prompt_tokens(req, model)
        if req.return_token_ids or keep is not None:
            encode = (await self.tokenizers.get(model)).encode
            prompt = _engine_prompt(prompt, encode, keep, as_ids=bool(req.return_token_ids))
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else None
        return _Plan(
            f"chatcmpl-{uuid.uuid4().hex}",
            int(time.time()),
            req.model,
            (prompt,),
            params,
            None,
            include,
            continuous,
            top,
            arrival,
            constraint,
            tools,
            show_prompt_logprobs=req.prompt_logprobs,
            return_token_ids=bool(req.return_token_ids),
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            chat_echo=echo,
        )

    async def _chat_chunks(self, plan: _Plan) -> AsyncIterator[dict[str, Any]]:
        gen = Generation(
            self.engine, plan.model, plan.prompts, plan.params, plan.request_id, self.metrics, plan.arrival
        )
        n = plan.params.n
        first = True
        tool_streams: dict[int, ToolCallStream] = {}
        async with aclosing(_named_errors(gen.events(), plan)) as events:
            async for p, out in events:
                index = p * n + out.seq_index
                if first:  # the role goes first, once per choice (after the engine accepted the request)
                    first = False
                    usage = Usage(gen.usage.prompt_tokens, 0) if plan.continuous_usage else None
                    for i in range(len(plan.prompts) * n):
                        role = {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                        chunk = _chunk(plan, "chat.completion.chunk", [role], usage)
                        if i == 0:  # vLLM's response-level fields travel on the first chunk
                            chunk |= _token_fields(plan, p, out, True, in_choice=False)
                        yield chunk
                    if plan.chat_echo:
                        for i in range(len(plan.prompts) * n):
                            echo = {
                                "index": i,
                                "delta": {"content": plan.chat_echo},
                                "logprobs": None,
                                "finish_reason": None,
                                "stop_reason": None,
                            }
                            yield _chunk(plan, "chat.completion.chunk", [echo], usage)
                logprobs = (
                    chat_logprobs(out, plan.top_logprobs, plan.tokens_as_ids)
                    if plan.params.logprobs is not None
                    else None
                )
                finish = out.finish_reason.value if out.finish_reason else None
                if plan.tools.active:
                    stream = tool_streams.setdefault(index, ToolCallStream(plan.tools))
                    deltas = stream.feed(out.text_delta) + (stream.finish() if finish else [])
                    if finish == "stop" and stream.called and plan.tools.mode != "named":
                        finish = "tool_calls"
                else:
                    deltas = [{"content": out.text_delta}]
                usage = gen.usage if plan.continuous_usage else None
                for delta in deltas[:-1]:
                    choice = {
                        "index": index,
                        "delta": delta,
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                    yield _chunk(plan, "chat.completion.chunk", [choice], usage)
                if deltas or logprobs is not None or finish or plan.return_token_ids:
                    choice = {
                        "index": index,
                        "delta": deltas[-1] if deltas else {},
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": out.stop_reason if finish else None,
                    }
                    choice |= _token_fields(plan, 0, out, False, in_choice=True)
                    yield _chunk(plan, "chat.completion.chunk", [choice], usage)
        if plan.include_usage:
            yield _chunk(plan, "chat.completion.chunk", [], gen.usage)


# -- helpers --------------------------------------------------------------------------------------


async def _named_errors(
    events: AsyncIterator[tuple[int, StepOutput]], plan: _Plan
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


def _merge_tool_call(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one streamed tool-call delta into the message's calls (header first, then arguments)."""
    i = delta["index"]
    while len(calls) <= i:
        calls.append({"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
    call = calls[i]
    if "id" in delta:
        call["id"], call["type"] = delta["id"], delta["type"]
    function = delta.get("function", {})
    if "name" in function:
        call["function"]["name"] = function["name"]
    call["function"]["arguments"] += function.get("arguments", "")


async def _primed(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """Await the first chunk now (errors surface as exceptions here), then replay it and the rest."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise

    async def replay() -> AsyncIterator[dict[str, Any]]:
        async with aclosing(chunks):
            if first is not None:
                yield first
            async for chunk in chunks:
                yield chunk

    return replay()


def _chunk(plan: _Plan, obj: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": plan.request_id,
        "object": obj,
        "created": plan.created,
        "model": plan.model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage.to_dict()
    return chunk


def _usage_options(req: SamplingFields, force: bool) -> tuple[bool, bool]:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    opts = req.stream_options
    # Per-chunk usage only when usage is asked for at all (OpenAI's and vLLM's rule).
    return force or bool(opts and opts.include_usage), bool(opts and opts.include_usage and opts.continuous_usage_stats)


def _kept_prompt_tokens(req: SamplingFields, model: ModelInfo) -> int | None:
    """vLLM's truncate_prompt_tokens: how many of a prompt's last tokens are kept (None: all of them;
    -1: as many as the context window holds)."""
    k = req.truncate_prompt_tokens
    if k is None:
        return None
    if k == 0 or k < -1:
        raise InvalidRequest(
            "truncate_prompt_tokens must be -1 (the context window) or at least 1", "truncate_prompt_tokens"
        )
    limit = model.max_model_len
    if k == -1:
        return limit
    if limit is not None and k > limit:
        raise InvalidRequest(
            f"truncate_prompt_tokens ({k}) is greater than the model's context window, max_model_len ({limit})",
            "truncate_prompt_tokens",
        )
    return k


def _engine_prompt(
    prompt: str | tuple[int, ...], encode: Callable[[str], list[int]], keep: int | None, as_ids: bool
) -> str | tuple[int, ...]:
    """What the engine is sent for `prompt`: its last `keep` tokens where it has more (vLLM's
    truncate_prompt_tokens cuts from the left), as ids where `as_ids` (return_token_ids), otherwise the
    prompt as given. A text prompt is tokenized once, and only when one of them asks for it."""
    if isinstance(prompt, str):
        if keep is None and not as_ids:
            return prompt
        ids = tuple(encode(prompt))
    else:
        ids = prompt
    if keep is not None and len(ids) > keep:
        return ids[-keep:]
    return ids if as_ids else prompt


def _normalize_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(prompt, str):
        return (prompt,)
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return (tuple(prompt),)  # one prompt of token ids
    out: list[str | tuple[int, ...]] = []
    for p in prompt:
        if isinstance(p, list):
            if not p:
                raise InvalidRequest("a token-id prompt must not be empty", "prompt")
            out.append(tuple(p))
        else:
            out.append(p)
    return tuple(out)


def _sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: Constraint | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    kwargs: dict[str, Any] = {
        "n": 1 if req.n is None else req.n,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "structured_outputs": constraint.spec if constraint else None,
        "ignore_eos": bool(req.ignore_eos),
        "include_stop_str_in_output": bool(req.include_stop_str_in_output),
        "skip_special_tokens": req.skip_special_tokens is not False,
    }
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
    ):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.stop is not None:
        kwargs["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.stop_token_ids is not None:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = tuple(req.allowed_token_ids)
    if req.bad_words is not None:
        kwargs["bad_words"] = tuple(req.bad_words)
    if req.logit_bias:
        try:
            kwargs["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in req.logit_bias.items()))
        except ValueError:
            raise InvalidRequest("logit_bias keys must be token ids", "logit_bias") from None
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequest(e.message, e.param) from None


_NO_COMPLETION_LOGPROBS: dict[str, list[Any]] = {
    "tokens": [],
    "token_logprobs": [],
    "top_logprobs": [],
    "text_offset": [],
}
_RESPONSE_FIELDS = ("prompt_token_ids", "prompt_logprobs")


def _token_fields(plan: _Plan, p: int, out: StepOutput, first: bool, in_choice: bool) -> dict[str, Any]:
    """vLLM's token-id and prompt fields of one chunk: `token_ids` on every choice chunk, the prompt's
    (`prompt_token_ids`, `prompt_logprobs`) once, on a choice (completions) or the response (chat)."""
    fields: dict[str, Any] = {}
    if plan.return_token_ids:
        if in_choice:
            fields["token_ids"] = [] if plan.echo_only else list(out.token_ids)
        if first:
            fields["prompt_token_ids"] = list(plan.prompts[p])
    if first and plan.show_prompt_logprobs is not None:
        pl = out.prompt_logprobs
        fields["prompt_logprobs"] = prompt_logprobs(pl, plan.show_prompt_logprobs, plan.tokens_as_ids) if pl else None
    return fields


def _merge_token_fields(acc: dict[str, Any], chunk_choice: dict[str, Any]) -> None:
    """Fold a chunk's token fields into the non-streamed choice."""
    for key in _RESPONSE_FIELDS:
        if key in chunk_choice:
            acc[key] = chunk_choice[key]
    if "token_ids" in chunk_choice:
        acc.setdefault("token_ids", []).extend(chunk_choice["token_ids"])


def _extend_lists(acc: dict[str, list[Any]] | None, new: dict[str, list[Any]]) -> dict[str, list[Any]]:
    if acc is None:
        return {key: list(values) for key, values in new.items()}
    for key, values in new.items():
        acc[key].extend(values)
    return acc
