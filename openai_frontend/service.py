"""The service layer: an OpenAI request -> engine requests -> OpenAI chunks or one response.

Streaming and non-streaming share one path: `_*_chunks` turns each checked StepOutput into exactly
one chunk (one choice, `index` = prompt_index * n + seq_index), and the non-streaming response is
those same chunks merged. So both give the same text, tokens and logprobs by construction.
The chunks are plain JSON-ready dicts; SSE framing is the router's job.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from backend.types import InvalidRequestError, SamplingParams, StepOutput
from openai_frontend.chat_template import render_chat, template_reads_tools
from openai_frontend.constraints import Constraint, request_constraint, tool_call_constraint
from openai_frontend.engine_client import EngineClient
from openai_frontend.errors import InvalidRequest
from openai_frontend.generation import Generation, Usage
from openai_frontend.metrics import Metrics
from openai_frontend.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from openai_frontend.settings import Settings
from openai_frontend.tool_calls import ToolCallStream, ToolPlan, forced_call_schema, template_messages, \
    template_tools, tool_plan


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


class Service:
    def __init__(self, engine: EngineClient, settings: Settings, metrics: Metrics) -> None:
        self.engine, self.settings, self.metrics = engine, settings, metrics

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
                    acc = choices.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None,
                                                          "finish_reason": None, "stop_reason": None})
                    acc["text"] += c["text"]
                    if c["logprobs"] is not None:
                        acc["logprobs"] = _extend_lists(acc["logprobs"], c["logprobs"])
                    acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c["stop_reason"]
        return {"id": plan.request_id, "object": "text_completion", "created": plan.created, "model": plan.model,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage}

    async def _completion_plan(self, req: CompletionRequest, force_usage: bool = False) -> _Plan:
        arrival = time.monotonic()
        if req.best_of is not None and req.best_of != (1 if req.n is None else req.n):
            raise InvalidRequest("best_of is only supported equal to n", "best_of")
        prompts = _normalize_prompts(req.prompt)
        echo_texts = None
        if req.echo:
            if req.logprobs is not None:
                raise InvalidRequest("echo with logprobs is not supported: the engine returns no prompt logprobs", "echo")
            if not all(isinstance(p, str) for p in prompts):
                raise InvalidRequest("echo is only supported for text prompts, not token ids", "echo")
            echo_texts = tuple(str(p) for p in prompts)
        max_tokens = req.max_tokens if req.max_tokens is not None else self.settings.default_max_tokens
        constraint = request_constraint(req)
        params = _sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, constraint=constraint)
        include, continuous = _usage_options(req, force_usage)
        await self.engine.model_config(req.model)  # ModelNotFound -> 404 before any work
        return _Plan(f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model, prompts, params, echo_texts,
                     include, continuous, 0, arrival, constraint)

    async def _completion_chunks(self, plan: _Plan) -> AsyncIterator[dict[str, Any]]:
        gen = Generation(self.engine, plan.model, plan.prompts, plan.params, plan.request_id, self.metrics, plan.arrival)
        n = plan.params.n
        offsets: dict[int, int] = {}  # per choice: characters of logprob tokens so far (text_offset)
        started: set[int] = set()
        async with aclosing(_named_errors(gen.events(), plan)) as events:
            async for p, out in events:
                index = p * n + out.seq_index
                text = out.text_delta
                if plan.echo_texts is not None and index not in started:
                    text = plan.echo_texts[p] + text
                started.add(index)
                logprobs = None
                if plan.params.logprobs is not None:
                    logprobs = _completion_logprobs(out, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
                finish = out.finish_reason.value if out.finish_reason else None
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                          "stop_reason": out.stop_reason if finish else None}
                yield _chunk(plan, "text_completion", [choice], gen.usage if plan.continuous_usage else None)
        if plan.include_usage:
            yield _chunk(plan, "text_completion", [], gen.usage)

    # -- chat completions ------------------------------------------------------------------------

    async def chat_stream(self, req: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        plan = await self._chat_plan(req)
        return await _primed(self._chat_chunks(plan))

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any]:
        plan = await self._chat_plan(req, force_usage=True)
        choices: dict[int, dict[str, Any]] = {}
        usage = None
        async with aclosing(self._chat_chunks(plan)) as chunks:
            async for chunk in chunks:
                usage = chunk.get("usage", usage)
                for c in chunk["choices"]:
                    acc = choices.setdefault(c["index"], {"index": c["index"],
                                                          "message": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None, "stop_reason": None})
                    message = acc["message"]
                    message["content"] += c["delta"].get("content", "")
                    for call in c["delta"].get("tool_calls", ()):
                        _merge_tool_call(message.setdefault("tool_calls", []), call)
                    if c["logprobs"] is not None:
                        acc["logprobs"] = _extend_lists(acc["logprobs"], c["logprobs"])
                    if "role" not in c["delta"]:
                        acc["finish_reason"], acc["stop_reason"] = c["finish_reason"], c["stop_reason"]
        for acc in choices.values():
            if acc["message"].get("tool_calls") and not acc["message"]["content"]:
                acc["message"]["content"] = None  # OpenAI: a message of calls only has no content
        return {"id": plan.request_id, "object": "chat.completion", "created": plan.created, "model": plan.model,
                "choices": [choices[i] for i in sorted(choices)], "usage": usage}

    async def _chat_plan(self, req: ChatCompletionRequest, force_usage: bool = False) -> _Plan:
        arrival = time.monotonic()
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise InvalidRequest("max_tokens and max_completion_tokens differ; give one", "max_completion_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self.settings.chat_default_max_tokens
        top = req.top_logprobs or 0
        try:
            tools = tool_plan(req)
        except LookupError as e:
            raise InvalidRequest(str(e), "tool_choice") from None
        constraint = request_constraint(req)
        forced = forced_call_schema(tools)
        if forced is not None:
            if constraint is not None:
                raise InvalidRequest(f"tool_choice {tools.mode!r} cannot be combined with {constraint.param}",
                                     constraint.param)
            constraint = tool_call_constraint(forced, "tools")
        params = _sampling_params(req, max_tokens=max_tokens, logprobs=top if req.logprobs else None,
                                  constraint=constraint)
        include, continuous = _usage_options(req, force_usage)
        model = await self.engine.model_config(req.model)
        knows_tools = bool(model.chat_template) and template_reads_tools(model.name, model.chat_template)
        messages = template_messages(req.messages, tools, knows_tools)
        prompt = render_chat(model, messages, template_tools(tools) if knows_tools else None)
        return _Plan(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model, (prompt,), params, None,
                     include, continuous, top, arrival, constraint, tools)

    async def _chat_chunks(self, plan: _Plan) -> AsyncIterator[dict[str, Any]]:
        gen = Generation(self.engine, plan.model, plan.prompts, plan.params, plan.request_id, self.metrics, plan.arrival)
        n = plan.params.n
        first = True
        tool_streams: dict[int, ToolCallStream] = {}
        async with aclosing(_named_errors(gen.events(), plan)) as events:
            async for p, out in events:
                index = p * n + out.seq_index
                if first:  # the role goes first, once per choice (after the engine accepted the request)
                    first = False
                    for i in range(len(plan.prompts) * n):
                        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None, "stop_reason": None}
                        usage = Usage(gen.usage.prompt_tokens, 0) if plan.continuous_usage else None
                        yield _chunk(plan, "chat.completion.chunk", [role], usage)
                logprobs = _chat_logprobs(out, plan.top_logprobs) if plan.params.logprobs is not None else None
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
                    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                              "stop_reason": None}
                    yield _chunk(plan, "chat.completion.chunk", [choice], usage)
                if deltas or logprobs is not None or finish:
                    choice = {"index": index, "delta": deltas[-1] if deltas else {}, "logprobs": logprobs,
                              "finish_reason": finish, "stop_reason": out.stop_reason if finish else None}
                    yield _chunk(plan, "chat.completion.chunk", [choice], usage)
        if plan.include_usage:
            yield _chunk(plan, "chat.completion.chunk", [], gen.usage)


# -- helpers --------------------------------------------------------------------------------------


async def _named_errors(events: AsyncIterator[tuple[int, StepOutput]], plan: _Plan
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
    chunk: dict[str, Any] = {"id": plan.request_id, "object": obj, "created": plan.created, "model": plan.model,
                             "choices": choices}
    if usage is not None:
        chunk["usage"] = usage.to_dict()
    return chunk


def _usage_options(req: SamplingFields, force: bool) -> tuple[bool, bool]:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    opts = req.stream_options
    # Per-chunk usage only when usage is asked for at all (OpenAI's and vLLM's rule).
    return force or bool(opts and opts.include_usage), bool(opts and opts.include_usage and opts.continuous_usage_stats)


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


def _sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                     constraint: Constraint | None = None) -> SamplingParams:
    kwargs: dict[str, Any] = {"n": 1 if req.n is None else req.n, "max_tokens": max_tokens, "logprobs": logprobs,
                              "structured_outputs": constraint.spec if constraint else None,
                              "ignore_eos": bool(req.ignore_eos),
                              "include_stop_str_in_output": bool(req.include_stop_str_in_output),
                              "skip_special_tokens": req.skip_special_tokens is not False}
    for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.stop is not None:
        kwargs["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if req.stop_token_ids is not None:
        kwargs["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.logit_bias:
        try:
            kwargs["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in req.logit_bias.items()))
        except ValueError:
            raise InvalidRequest("logit_bias keys must be token ids", "logit_bias") from None
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError as e:
        raise InvalidRequest(e.message, e.param) from None


def _logprob(value: float) -> float:
    """JSON has no -inf or NaN: clamp to -9999.0 as vLLM does."""
    return value if math.isfinite(value) and value > -9999.0 else -9999.0


def _completion_logprobs(out: StepOutput, text_offset: int) -> dict[str, list[Any]]:
    """Legacy completions logprobs of one step, vLLM style: top_logprobs holds the sampled token
    and then the top-k alternatives (so logprobs=0 gives just the sampled token)."""
    lp = out.logprobs
    if lp is None:  # a step without tokens (an abort) may come without logprob outputs
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offsets, top = [], []
    for i, token_id in enumerate(out.token_ids):
        offsets.append(text_offset)
        text_offset += len(lp.token_texts[i])
        entry = {lp.token_texts[i]: _logprob(lp.logprobs[i])}
        for alt_id, alt_text, alt_lp in zip(lp.top_token_ids[i], lp.top_token_texts[i], lp.top_logprobs[i]):
            if alt_id != token_id:
                entry.setdefault(alt_text, _logprob(alt_lp))
        top.append(entry)
    return {"tokens": list(lp.token_texts), "token_logprobs": [_logprob(x) for x in lp.logprobs],
            "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(out: StepOutput, top_k: int) -> dict[str, list[Any]]:
    lp = out.logprobs
    if lp is None:  # a step without tokens
        return {"content": []}
    content = []
    for i in range(len(out.token_ids)):
        alts = [{"token": t, "logprob": _logprob(x), "bytes": list(t.encode("utf-8"))}
                for t, x in zip(lp.top_token_texts[i][:top_k], lp.top_logprobs[i][:top_k])]
        text = lp.token_texts[i]
        content.append({"token": text, "logprob": _logprob(lp.logprobs[i]), "bytes": list(text.encode("utf-8")),
                        "top_logprobs": alts})
    return {"content": content}


def _extend_lists(acc: dict[str, list[Any]] | None, new: dict[str, list[Any]]) -> dict[str, list[Any]]:
    if acc is None:
        return {key: list(values) for key, values in new.items()}
    for key, values in new.items():
        acc[key].extend(values)
    return acc

