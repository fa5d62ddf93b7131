"""Logprobs in the shapes clients read: OpenAI's legacy completions and chat formats (the logprobs
models of responses.py), and vLLM's `prompt_logprobs`. Pure functions of the engine's messages.

`as_ids` is vLLM's `return_tokens_as_token_ids`: every token is named `token_id:<id>` instead of its
text (texts of partial UTF-8 characters are not unique; ids are).
"""

from __future__ import annotations

import math
from typing import Any

from openai_frontend.responses import ChatCompletionLogProbs, ChatCompletionLogProbsContent, CompletionLogProbs
from protocol import PromptLogprobs, StepOutput


def clamp(value: float) -> float:
    """JSON has no -inf or NaN: clamp to -9999.0 as vLLM does."""
    return value if math.isfinite(value) and value > -9999.0 else -9999.0


def token_name(text: str, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else text


def no_completion_logprobs() -> CompletionLogProbs:
    return CompletionLogProbs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])


def completion_logprobs(out: StepOutput, text_offset: int, as_ids: bool = False) -> CompletionLogProbs:
    """Legacy completions logprobs of one step, vLLM style: top_logprobs holds the sampled token
    and then the top-k alternatives (so logprobs=0 gives just the sampled token)."""
    lp = out.logprobs
    if lp is None:  # a step without tokens (an abort) may come without logprob outputs
        return no_completion_logprobs()
    tokens, offsets, top = [], [], []
    for i, token_id in enumerate(out.token_ids):
        offsets.append(text_offset)
        text_offset += len(lp.token_texts[i])
        tokens.append(token_name(lp.token_texts[i], token_id, as_ids))
        top.append(
            _top_entry(
                tokens[-1],
                lp.logprobs[i],
                token_id,
                lp.top_token_ids[i],
                lp.top_token_texts[i],
                lp.top_logprobs[i],
                as_ids,
            )
        )
    return CompletionLogProbs(
        tokens=tokens, token_logprobs=[clamp(x) for x in lp.logprobs], top_logprobs=top, text_offset=offsets
    )


def echo_logprobs(pl: PromptLogprobs, k: int, as_ids: bool = False) -> CompletionLogProbs:
    """The prompt's part of echoed completions logprobs (k alternatives): its first token has none
    (null), as in OpenAI's legacy API and vLLM; offsets count from the start of the prompt text."""
    tokens = [token_name(t, i, as_ids) for t, i in zip(pl.token_texts, pl.token_ids)]
    offsets, offset = [], 0
    for text in pl.token_texts:
        offsets.append(offset)
        offset += len(text)
    top: list[dict[str, float] | None] = [None]
    for j in range(len(pl.logprobs)):
        top.append(
            _top_entry(
                tokens[j + 1],
                pl.logprobs[j],
                pl.token_ids[j + 1],
                pl.top_token_ids[j][:k],
                pl.top_token_texts[j][:k],
                pl.top_logprobs[j][:k],
                as_ids,
            )
        )
    return CompletionLogProbs(
        tokens=tokens, token_logprobs=[None, *(clamp(x) for x in pl.logprobs)], top_logprobs=top, text_offset=offsets
    )


def prompt_logprobs(pl: PromptLogprobs, k: int, as_ids: bool = False) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token a dict keyed by token id
    (as a JSON string) holding the prompt token and the top k, each with logprob, rank, decoded_token."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for j in range(len(pl.logprobs)):
        token_id = pl.token_ids[j + 1]
        entry = {
            str(token_id): {
                "logprob": clamp(pl.logprobs[j]),
                "rank": pl.ranks[j],
                "decoded_token": token_name(pl.token_texts[j + 1], token_id, as_ids),
            }
        }
        for rank, (alt_id, alt_text, alt_lp) in enumerate(
            zip(pl.top_token_ids[j][:k], pl.top_token_texts[j][:k], pl.top_logprobs[j][:k]), start=1
        ):
            entry.setdefault(
                str(alt_id),
                {"logprob": clamp(alt_lp), "rank": rank, "decoded_token": token_name(alt_text, alt_id, as_ids)},
            )
        out.append(entry)
    return out


def chat_logprobs(out: StepOutput, top_k: int, as_ids: bool = False) -> ChatCompletionLogProbs:
    lp = out.logprobs
    content: list[ChatCompletionLogProbsContent] = []
    if lp is None:  # a step without tokens
        return ChatCompletionLogProbs(content=content)
    for i, token_id in enumerate(out.token_ids):
        alts = []
        for alt_id, alt_text, alt_lp in zip(
            lp.top_token_ids[i][:top_k], lp.top_token_texts[i][:top_k], lp.top_logprobs[i][:top_k]
        ):
            name = token_name(alt_text, alt_id, as_ids)
            alts.append({"token": name, "logprob": clamp(alt_lp), "bytes": list(name.encode("utf-8"))})
        name = token_name(lp.token_texts[i], token_id, as_ids)
        content.append(
            {"token": name, "logprob": clamp(lp.logprobs[i]), "bytes": list(name.encode("utf-8")), "top_logprobs": alts}
        )
    return ChatCompletionLogProbs(content=content)


def _top_entry(
    name: str,
    logprob: float,
    token_id: int,
    alt_ids: tuple[int, ...],
    alt_texts: tuple[str, ...],
    alt_logprobs: tuple[float, ...],
    as_ids: bool,
) -> dict[str, float]:
    entry = {name: clamp(logprob)}
    for alt_id, alt_text, alt_lp in zip(alt_ids, alt_texts, alt_logprobs):
        if alt_id != token_id:
            entry.setdefault(token_name(alt_text, alt_id, as_ids), clamp(alt_lp))
    return entry
