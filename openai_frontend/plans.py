"""A request's plan: what a service derives from the HTTP body before any engine work (one plan type
per endpoint), and the checks and conversions both endpoints share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from openai_frontend.constraints import Constraint
from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import InvalidRequest
from openai_frontend.request_log import response_ids
from openai_frontend.schemas import SamplingFields
from openai_frontend.tool_calls import ToolPlan
from protocol import InvalidRequestError, SamplingParams

Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationPlan:
    """What both endpoints' plans hold: the engine work and the fields every chunk carries."""

    request_id: str  # the response's id: `<prefix>-<X-Request-Id>` (request_log.py)
    engine_request_id: str  # the Triton request id: unique even when clients' ids repeat
    created: int
    model: str
    prompts: tuple[Prompt, ...]
    params: SamplingParams
    arrival: float
    constraint: Constraint | None  # the output constraint and the field it came from
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # usage on every chunk
    show_prompt_logprobs: int | None  # vLLM's prompt_logprobs k: the field in the response
    return_token_ids: bool  # prompts go as token ids; responses carry prompt_token_ids and token_ids
    tokens_as_ids: bool  # logprob tokens named `token_id:<id>`

    @classmethod
    def of(
        cls,
        req: SamplingFields,
        *,
        model: ModelInfo,
        id_prefix: str,
        prompts: tuple[Prompt, ...],
        params: SamplingParams,
        arrival: float,
        constraint: Constraint | None,
        usage: tuple[bool, bool],
        **own: Any,
    ) -> Self:
        """A plan of `req` to `model`: the fields every plan fills alike, and the endpoint's `own` fields."""
        include_usage, continuous_usage = usage
        request_id, engine_request_id = response_ids(id_prefix)
        return cls(
            request_id=request_id,
            engine_request_id=engine_request_id,
            created=int(time.time()),
            model=model.name,  # the name responses report and the engine client is asked for (served_names.py)
            prompts=prompts,
            params=params,
            arrival=arrival,
            constraint=constraint,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            show_prompt_logprobs=req.prompt_logprobs,
            return_token_ids=bool(req.return_token_ids),
            tokens_as_ids=bool(req.return_tokens_as_token_ids),
            **own,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionPlan(GenerationPlan):
    echo_texts: tuple[str, ...] | None  # echo: the text put before each prompt's choices
    echo_logprobs: int | None  # echo with logprobs k: the prompt's logprobs lead each choice's
    echo_only: bool  # echo with max_tokens 0: the engine's one token is not shown


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPlan(GenerationPlan):
    top_logprobs: int  # how many alternatives to show per token
    tools: ToolPlan  # how the output's tool calls are read
    # echo: per prompt, the last (assistant) message's content, which starts each of its choices (None: none)
    echo: tuple[str | None, ...]
    batch: bool  # a batched chat: one prompt per conversation, and no response-level prompt fields


def usage_options(req: SamplingFields, force: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage) of a request; `force` for a non-streamed one, whose body has usage."""
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
    opts = req.stream_options
    # Per-chunk usage only when usage is asked for at all (OpenAI's and vLLM's rule).
    return force or bool(opts and opts.include_usage), bool(opts and opts.include_usage and opts.continuous_usage_stats)


def kept_prompt_tokens(req: SamplingFields, model: ModelInfo) -> int | None:
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


def engine_prompt(prompt: Prompt, encode: Callable[[str], list[int]], keep: int | None, as_ids: bool) -> Prompt:
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


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: Constraint | None,
    prompt_logprobs: int | None,
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
        "use_beam_search": bool(req.use_beam_search),
    }
    if req.use_beam_search and constraint is not None:
        raise InvalidRequest(f"{constraint.param} is not supported with use_beam_search", constraint.param)
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
        "length_penalty",
        "early_stopping",
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


def engine_prompts(prompt: str | list[str] | list[int] | list[list[int]], param: str) -> tuple[Prompt, ...]:
    """The engine prompts of a completions `prompt` or an embeddings `input` (named `param` in errors): a
    string, a list of them, or token ids, where a list of ints is one prompt."""
    if isinstance(prompt, str):
        return (prompt,)
    if not prompt:
        raise InvalidRequest(f"{param} must not be empty", param)
    if isinstance(prompt[0], int):  # (the schema's union: all items are of one kind)
        return (tuple(prompt),)  # one prompt of token ids
    out: list[Prompt] = []
    for p in prompt:
        if isinstance(p, list):
            if not p:
                raise InvalidRequest(f"a token-id {param} must not be empty", param)
            out.append(tuple(p))
        else:
            out.append(p)
    return tuple(out)
