"""The Triton tensors of one StepOutput, both ways (docs/wire-contract.md). No torch.

`encode_step` is what the Triton adapter sends (triton_backend/adapter.py) and `decode_step`
what the frontend's Triton client reads back, so the two sides cannot drift apart: a round-trip test
holds them together. The model's text tensors are numpy object arrays of UTF-8 bytes, as Triton's
BYTES type is; the frontend decodes the raw bytes tritonserver sends.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from protocol import (
    AdmissionGroup,
    FinishReason,
    InvalidRequestError,
    PromptLogprobs,
    RequestTimings,
    StepOutput,
    Task,
    TokenLogprobs,
)

# The outputs of every step message.
STEP_OUTPUTS = ("seq_index", "step", "token_ids", "text_delta", "num_prompt_tokens", "num_output_tokens")
# Only in a sequence's last message; absent means the sequence goes on. Most messages are not a
# sequence's last, and each tensor costs every process on the path (text ones the most).
FINISH_OUTPUTS = ("finish_reason", "stop_reason")
# Only in a response that joined several steps of a sequence (backend/coalescing.py); absent means 1.
NUM_STEPS_OUTPUT = "num_steps"
# Only in a response of a sequence whose prompt hit the prefix cache; absent means 0 (so a model that does
# not send it reads as no hit).
NUM_CACHED_TOKENS_OUTPUT = "num_cached_tokens"
# Only in the one response of an embedding request: its pooled vector (FP32, [hidden]).
EMBEDDING_OUTPUT = "embedding"
# Only in a sequence's last response: its RequestTimings (FP64, [3]: queued_s, prefill_s, decode_s); absent
# means not measured (a model that does not send it).
ENGINE_TIMINGS_OUTPUT = "engine_timings"
# An optional request input (BYTES [1]): the request's Task ("generate" when absent).
TASK_INPUT = "task"
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

# Triton's model-repository API (index, load, unload) answers only requests carrying this header (HTTP) or
# metadata key (gRPC) with the control key: the launcher's stub supervisor and the frontends, which share
# the key through this environment variable (docs/wire-contract.md, "Model control").
CONTROL_KEY_HEADER = "llm-control-key"
CONTROL_KEY_GRPC_METADATA = f"triton-grpc-protocol-{CONTROL_KEY_HEADER}"  # (how Triton's gRPC endpoint names it)
CONTROL_KEY_ENV = "LLM_TRITON_CONTROL_KEY"

# A request parameter (bool) of a client that sends a cancel message when it stops listening (the frontend):
# the engine then asks whether such a request's call was cancelled only as a backstop (docs/wire-contract.md).
SENDS_CANCEL_MESSAGE = "sends_cancel_message"


# Request parameters (string, int) of a client request whose prompts travel as several Triton requests:
# the key they share and how many there are. The engine's queue bound judges the first to arrive only
# (backend/admission.py).
ADMISSION_GROUP = "admission_group"
ADMISSION_GROUP_SIZE = "admission_group_size"


def _parameters(request_parameters: str) -> dict:
    """The JSON object python_backend's `request.parameters()` gives ({} when it is not one)."""
    try:
        parameters = json.loads(request_parameters or "{}")
    except ValueError:
        return {}
    return parameters if isinstance(parameters, dict) else {}


def sends_cancel_message(request_parameters: str) -> bool:
    """Whether a request's parameters say that its client sends cancel messages."""
    return _parameters(request_parameters).get(SENDS_CANCEL_MESSAGE) is True


def admission_group(request_parameters: str) -> AdmissionGroup | None:
    """The admission group a request's parameters name (None: none, or not well-formed)."""
    parameters = _parameters(request_parameters)
    key, size = parameters.get(ADMISSION_GROUP), parameters.get(ADMISSION_GROUP_SIZE)
    if not isinstance(key, str) or not key or isinstance(size, bool) or not isinstance(size, int) or size < 1:
        return None
    return AdmissionGroup(key, size)


def task(value: str | None) -> Task:
    """The Task a request's `task` input names (absent: generate); an unknown one is refused."""
    if value is None:
        return Task.GENERATE
    try:
        return Task(value)
    except ValueError:
        kinds = ", ".join(t.value for t in Task)
        raise InvalidRequestError(f"task must be one of {kinds}, not {value!r}", TASK_INPUT) from None


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
    if out.num_cached_tokens:
        arrays[NUM_CACHED_TOKENS_OUTPUT] = np.array([out.num_cached_tokens], dtype=np.int32)
    if out.embedding is not None:
        arrays[EMBEDDING_OUTPUT] = np.array(out.embedding, dtype=np.float32).reshape(len(out.embedding))
    t = out.timings
    if t is not None:
        arrays[ENGINE_TIMINGS_OUTPUT] = np.array([t.queued_s, t.prefill_s, t.decode_s], dtype=np.float64)
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


# One output tensor as Triton carries it: (datatype, shape, raw bytes). Numbers are little-endian;
# a BYTES tensor is each element's 4-byte length followed by its bytes.
RawTensor = tuple[str, tuple[int, ...], bytes]


def decode_step(tensors: Mapping[str, RawTensor], request_id: str, request_finished: bool) -> StepOutput:
    """The StepOutput of one response, from its output tensors by name (absent ones are not in it).

    Decoded straight from the raw bytes: a response is a handful of tiny tensors, and numpy arrays
    cost more to make than the values they hold. Raises WireError when a tensor of the contract is
    missing or malformed.
    """
    try:
        finish, stop_reason = _finish(tensors)
        return StepOutput(
            request_id=request_id,
            seq_index=_scalar_int(tensors, "seq_index"),
            step=_scalar_int(tensors, "step"),
            token_ids=_ints(_required(tensors, "token_ids")),
            text_delta=_scalar_text(tensors, "text_delta"),
            logprobs=_decode_logprobs(tensors),
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=_scalar_int(tensors, "num_prompt_tokens"),
            num_output_tokens=_scalar_int(tensors, "num_output_tokens"),
            request_finished=request_finished,
            prompt_logprobs=_decode_prompt_logprobs(tensors),
            num_steps=_num_steps(tensors),
            num_cached_tokens=_num_cached_tokens(tensors),
            embedding=_floats(tensors[EMBEDDING_OUTPUT]) if EMBEDDING_OUTPUT in tensors else None,
            timings=_timings(tensors),
        )
    except WireError:
        raise
    except (ValueError, IndexError, UnicodeDecodeError, struct.error) as e:  # JSON, enum, sizes, UTF-8
        raise WireError(f"malformed response: {e}") from None


def _required(tensors: Mapping[str, RawTensor], name: str) -> RawTensor:
    tensor = tensors.get(name)
    if tensor is None:
        raise WireError(f"the response lacks output `{name}`")
    return tensor


def _scalar_int(tensors: Mapping[str, RawTensor], name: str) -> int:
    values = _ints(_required(tensors, name))
    if len(values) != 1:
        raise ValueError(f"`{name}` must hold one value, not {len(values)}")
    return values[0]


def _scalar_text(tensors: Mapping[str, RawTensor], name: str) -> str:
    values = _strs(_required(tensors, name))
    if len(values) != 1:
        raise ValueError(f"`{name}` must hold one string, not {len(values)}")
    return values[0]


def _num_steps(tensors: Mapping[str, RawTensor]) -> int:
    num_steps = _scalar_int(tensors, NUM_STEPS_OUTPUT) if NUM_STEPS_OUTPUT in tensors else 1
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, not {num_steps}")
    return num_steps


def _num_cached_tokens(tensors: Mapping[str, RawTensor]) -> int:
    if NUM_CACHED_TOKENS_OUTPUT not in tensors:
        return 0
    num_cached = _scalar_int(tensors, NUM_CACHED_TOKENS_OUTPUT)
    if num_cached < 0:
        raise ValueError(f"num_cached_tokens must be >= 0, not {num_cached}")
    return num_cached


def _timings(tensors: Mapping[str, RawTensor]) -> RequestTimings | None:
    if ENGINE_TIMINGS_OUTPUT not in tensors:
        return None
    values = _numbers(tensors[ENGINE_TIMINGS_OUTPUT], "FP64", "d")
    if len(values) != 3 or not all(v >= 0 for v in values):  # (NaN is not >= 0 either)
        raise ValueError(f"{ENGINE_TIMINGS_OUTPUT} must hold 3 durations >= 0, not {list(values)}")
    return RequestTimings(*values)


def _finish(tensors: Mapping[str, RawTensor]) -> tuple[FinishReason | None, str | int | None]:
    if _all_or_none(tensors, FINISH_OUTPUTS) is None:
        return None, None
    finish, stop = (_scalar_text(tensors, name) for name in FINISH_OUTPUTS)
    stop_reason = json.loads(stop or "null")
    if stop_reason is not None and (isinstance(stop_reason, bool) or not isinstance(stop_reason, (str, int))):
        raise ValueError(f"stop_reason must be null, a string or an integer, not {stop_reason!r}")
    return FinishReason(finish), stop_reason


def _decode_logprobs(tensors: Mapping[str, RawTensor]) -> TokenLogprobs | None:
    parts = _all_or_none(tensors, LOGPROB_OUTPUTS)
    if parts is None:
        return None
    lp, texts, top_ids, top_lps, top_texts = parts
    logprobs = _floats(lp)
    return TokenLogprobs(
        logprobs=logprobs, token_texts=_strs(texts), **_top(top_ids, top_lps, top_texts, len(logprobs))
    )


def _decode_prompt_logprobs(tensors: Mapping[str, RawTensor]) -> PromptLogprobs | None:
    parts = _all_or_none(tensors, PROMPT_LOGPROB_OUTPUTS)
    if parts is None:
        return None
    ids, texts, lp, ranks, top_ids, top_lps, top_texts = parts
    token_ids, token_texts, logprobs, prompt_ranks = _ints(ids), _strs(texts), _floats(lp), _ints(ranks)
    if len(token_ids) != len(token_texts) or len(prompt_ranks) != len(logprobs):
        raise ValueError("prompt logprob outputs disagree on their lengths")
    return PromptLogprobs(
        token_ids=token_ids,
        token_texts=token_texts,
        logprobs=logprobs,
        ranks=prompt_ranks,
        **_top(top_ids, top_lps, top_texts, len(logprobs)),
    )


def _all_or_none(tensors: Mapping[str, RawTensor], names: Sequence[str]) -> list[RawTensor] | None:
    if names[0] not in tensors:
        return None
    missing = [name for name in names if name not in tensors]
    if missing:
        raise ValueError(f"outputs {', '.join(missing)} missing beside {names[0]}")
    return [tensors[name] for name in names]


def _top(ids: RawTensor, lps: RawTensor, texts: RawTensor, n: int) -> dict[str, Any]:
    """The [n, k] alternatives of n tokens, as n rows of k."""
    shape = ids[1]
    k = shape[-1] if len(shape) == 2 else 0
    return {
        "top_token_ids": _rows(_ints(ids), n, k),
        "top_logprobs": _rows(_floats(lps), n, k),
        "top_token_texts": _rows(_strs(texts), n, k),
    }


def _rows(values: tuple[Any, ...], n: int, k: int) -> tuple[tuple[Any, ...], ...]:
    if len(values) != n * k:
        raise ValueError(f"{len(values)} values do not make {n} rows of {k}")
    return tuple(values[i * k : (i + 1) * k] for i in range(n))


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def _numbers(tensor: RawTensor, datatype: str, code: str) -> tuple[Any, ...]:
    kind, shape, data = tensor
    if kind != datatype:
        raise ValueError(f"expected {datatype}, got {kind}")
    count = _size(shape)
    if len(data) != _WIDTHS[code] * count:
        raise ValueError(f"{len(data)} bytes for {count} {datatype} values")
    return struct.unpack(f"<{count}{code}", data)


def _ints(tensor: RawTensor) -> tuple[int, ...]:
    return _numbers(tensor, "INT32", "i")


def _floats(tensor: RawTensor) -> tuple[float, ...]:
    return _numbers(tensor, "FP32", "f")


def _strs(tensor: RawTensor) -> tuple[str, ...]:
    kind, shape, data = tensor
    if kind != "BYTES":
        raise ValueError(f"expected BYTES, got {kind}")
    out, i, end = [], 0, len(data)
    while i < end:
        (length,) = _LENGTH.unpack_from(data, i)
        i += 4 + length
        if i > end:
            raise ValueError("a BYTES element runs past the tensor's end")
        out.append(data[i - length : i].decode("utf-8"))
    if len(out) != _size(shape):
        raise ValueError(f"{len(out)} strings for shape {list(shape)}")
    return tuple(out)


_LENGTH = struct.Struct("<I")
_WIDTHS = {"i": 4, "f": 4, "d": 8}  # bytes per value of each struct code _numbers reads


def _width(rows: tuple[tuple[Any, ...], ...]) -> int:
    return len(rows[0]) if rows else 0


def _texts(values: Sequence[str], shape: tuple[int, ...]) -> np.ndarray:
    return np.array([v.encode("utf-8") for v in values], dtype=np.object_).reshape(shape)
