"""The Triton tensors of one StepOutput, both ways (docs/wire-contract.md). No torch.

`encode_step` is what the Triton model sends (model_repository/<model>/1/model.py) and `decode_step`
what the frontend's Triton client reads back, so the two sides cannot drift apart: a round-trip test
holds them together. Text tensors are numpy object arrays of UTF-8 bytes, as Triton's BYTES type is.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backend.types import FinishReason, PromptLogprobs, StepOutput, TokenLogprobs

# The outputs of every step message.
STEP_OUTPUTS = ("seq_index", "step", "token_ids", "text_delta", "num_prompt_tokens", "num_output_tokens")
# Only in a sequence's last message; absent means the sequence goes on. Most messages are not a
# sequence's last, and each tensor costs every process on the path (text ones the most).
FINISH_OUTPUTS = ("finish_reason", "stop_reason")
# Only in a response that joined several steps of a sequence (backend/coalescing.py); absent means 1.
NUM_STEPS_OUTPUT = "num_steps"
LOGPROB_OUTPUTS = ("logprobs", "token_texts", "top_token_ids", "top_logprobs", "top_token_texts")
PROMPT_LOGPROB_OUTPUTS = (
    "prompt_token_ids",
    "prompt_token_texts",
    "prompt_logprobs",
    "prompt_ranks",
    "prompt_top_token_ids",
    "prompt_top_logprobs",
    "prompt_top_token_texts",
)


class WireError(ValueError):
    """A response that does not follow the contract (a missing or malformed tensor)."""


def encode_step(out: StepOutput) -> dict[str, np.ndarray]:
    """The named output tensors of one step message."""
    arrays = {
        "seq_index": np.array([out.seq_index], dtype=np.int32),
        "step": np.array([out.step], dtype=np.int32),
        "token_ids": np.array(out.token_ids, dtype=np.int32).reshape(len(out.token_ids)),
        "text_delta": _texts([out.text_delta], (1,)),
        "num_prompt_tokens": np.array([out.num_prompt_tokens], dtype=np.int32),
        "num_output_tokens": np.array([out.num_output_tokens], dtype=np.int32),
    }
    if out.finish_reason is not None:
        arrays["finish_reason"] = _texts([out.finish_reason.value], (1,))
        arrays["stop_reason"] = _texts([json.dumps(out.stop_reason)], (1,))
    if out.num_steps != 1:
        arrays[NUM_STEPS_OUTPUT] = np.array([out.num_steps], dtype=np.int32)
    lp = out.logprobs
    if lp is not None:
        n, k = len(lp.logprobs), _width(lp.top_token_ids)
        arrays |= {
            "logprobs": np.array(lp.logprobs, dtype=np.float32).reshape(n),
            "token_texts": _texts(lp.token_texts, (n,)),
            "top_token_ids": np.array(lp.top_token_ids, dtype=np.int32).reshape(n, k),
            "top_logprobs": np.array(lp.top_logprobs, dtype=np.float32).reshape(n, k),
            "top_token_texts": _texts([s for row in lp.top_token_texts for s in row], (n, k)),
        }
    pl = out.prompt_logprobs
    if pl is not None:
        p, n, k = len(pl.token_ids), len(pl.logprobs), _width(pl.top_token_ids)
        arrays |= {
            "prompt_token_ids": np.array(pl.token_ids, dtype=np.int32).reshape(p),
            "prompt_token_texts": _texts(pl.token_texts, (p,)),
            "prompt_logprobs": np.array(pl.logprobs, dtype=np.float32).reshape(n),
            "prompt_ranks": np.array(pl.ranks, dtype=np.int32).reshape(n),
            "prompt_top_token_ids": np.array(pl.top_token_ids, dtype=np.int32).reshape(n, k),
            "prompt_top_logprobs": np.array(pl.top_logprobs, dtype=np.float32).reshape(n, k),
            "prompt_top_token_texts": _texts([s for row in pl.top_token_texts for s in row], (n, k)),
        }
    return arrays


def _num_steps(get: Callable[[str], np.ndarray | None]) -> int:
    array = get(NUM_STEPS_OUTPUT)
    num_steps = 1 if array is None else int(array.reshape(-1)[0])
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, not {num_steps}")
    return num_steps


def decode_step(get: Callable[[str], np.ndarray | None], request_id: str, request_finished: bool) -> StepOutput:
    """The StepOutput of one response; `get(name)` returns an output tensor or None when absent.

    Raises WireError when a tensor of the contract is missing or malformed.
    """

    def tensor(name: str) -> np.ndarray:
        array = get(name)
        if array is None:
            raise WireError(f"the response lacks output `{name}`")
        return array

    def scalar_int(name: str) -> int:
        return int(tensor(name).reshape(-1)[0])

    def scalar_text(name: str) -> str:
        return _text(tensor(name).reshape(-1)[0])

    try:
        finish, stop_reason = _finish(get)
        return StepOutput(
            request_id=request_id,
            seq_index=scalar_int("seq_index"),
            step=scalar_int("step"),
            token_ids=_ints(tensor("token_ids")),
            text_delta=scalar_text("text_delta"),
            logprobs=_decode_logprobs(get),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=scalar_int("num_prompt_tokens"),
            num_output_tokens=scalar_int("num_output_tokens"),
            request_finished=request_finished,
            prompt_logprobs=_decode_prompt_logprobs(get),
            num_steps=_num_steps(get),
        )
    except WireError:
        raise
    except (ValueError, IndexError, UnicodeDecodeError) as e:  # JSON, enum, reshape, empty tensors, UTF-8
        raise WireError(f"malformed response: {e}") from None


def _finish(get: Callable[[str], np.ndarray | None]) -> tuple[FinishReason | None, str | int | None]:
    parts = _all_or_none(get, FINISH_OUTPUTS)
    if parts is None:
        return None, None
    finish, stop = (_text(a.reshape(-1)[0]) for a in parts)
    stop_reason = json.loads(stop or "null")
    if stop_reason is not None and (isinstance(stop_reason, bool) or not isinstance(stop_reason, (str, int))):
        raise ValueError(f"stop_reason must be null, a string or an integer, not {stop_reason!r}")
    return FinishReason(finish), stop_reason


def _decode_logprobs(get: Callable[[str], np.ndarray | None]) -> TokenLogprobs | None:
    parts = _all_or_none(get, LOGPROB_OUTPUTS)
    if parts is None:
        return None
    lp, texts, top_ids, top_lps, top_texts = parts
    n = lp.reshape(-1).shape[0]
    return TokenLogprobs(logprobs=_floats(lp), token_texts=_strs(texts), **_top(top_ids, top_lps, top_texts, n))


def _decode_prompt_logprobs(get: Callable[[str], np.ndarray | None]) -> PromptLogprobs | None:
    parts = _all_or_none(get, PROMPT_LOGPROB_OUTPUTS)
    if parts is None:
        return None
    ids, texts, lp, ranks, top_ids, top_lps, top_texts = parts
    n = lp.reshape(-1).shape[0]
    if ids.reshape(-1).shape[0] != texts.reshape(-1).shape[0] or ranks.reshape(-1).shape[0] != n:
        raise ValueError("prompt logprob outputs disagree on their lengths")
    return PromptLogprobs(
        token_ids=_ints(ids),
        token_texts=_strs(texts),
        logprobs=_floats(lp),
        ranks=_ints(ranks),
        **_top(top_ids, top_lps, top_texts, n),
    )


def _all_or_none(get: Callable[[str], np.ndarray | None], names: Sequence[str]) -> list[np.ndarray] | None:
    arrays = [get(name) for name in names]
    if arrays[0] is None:
        return None
    missing = [name for name, a in zip(names, arrays) if a is None]
    if missing:
        raise ValueError(f"outputs {', '.join(missing)} missing beside {names[0]}")
    return arrays  # type: ignore[return-value]


def _top(ids: np.ndarray, lps: np.ndarray, texts: np.ndarray, n: int) -> dict[str, Any]:
    k = ids.shape[-1] if ids.ndim == 2 else 0
    ids, lps, texts = (a.reshape(n, k) for a in (ids, lps, texts))
    return {
        "top_token_ids": tuple(tuple(int(t) for t in row) for row in ids),
        "top_logprobs": tuple(tuple(float(x) for x in row) for row in lps),
        "top_token_texts": tuple(tuple(_text(t) for t in row) for row in texts),
    }


def _width(rows: tuple[tuple[Any, ...], ...]) -> int:
    return len(rows[0]) if rows else 0


def _texts(values: Sequence[str], shape: tuple[int, ...]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_).reshape(shape)


def _ints(array: np.ndarray) -> tuple[int, ...]:
    return tuple(int(t) for t in array.reshape(-1))


def _floats(array: np.ndarray) -> tuple[float, ...]:
    return tuple(float(x) for x in array.reshape(-1))


def _strs(array: np.ndarray) -> tuple[str, ...]:
    return tuple(_text(t) for t in array.reshape(-1))


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
