"""The messages that cross a thread or process boundary: what goes in (GenerateRequest) and what
comes out (StepOutput, RequestFailure).

Frozen, slotted dataclasses of immutable values (tuples, str, int, float): a message built on the
engine thread can be read by the sender thread while the engine goes on changing its own state
(invariant 1 of docs/contract.md), which is why nothing here is a list or a dict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.errors import EngineOverloaded, InvalidRequestError
from protocol.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class AdmissionGroup:
    """The engine requests of one client request (`size` of them, sharing `key`): the queue bound judges
    the first to arrive, and the others join it (backend/admission.py)."""

    key: str
    size: int


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or failed


class Task(str, enum.Enum):
    """What a request asks of the model."""

    GENERATE = "generate"  # sample tokens after the prompt
    EMBED = "embed"  # run the prompt only; its result is the pooled last hidden state (docs/embeddings.md)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request as the engine receives it: already tokenized, already validated."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
    task: Task = Task.GENERATE


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs of the tokens new in one step, one entry per token (parallel tuples).

    Values are the model's raw log-softmax over the full vocabulary, before temperature,
    penalties and top-k/top-p (vLLM's `raw_logprobs`). `token_texts[i]` is the text that token
    added to the output (so the texts of a sequence join to its text; "" for a skipped special
    token or for a token that ends mid-character). Top alternatives are the k most likely tokens
    under the same distribution, each with its own decoded string.
    """

    logprobs: tuple[float, ...]  # (tokens,)
    token_texts: tuple[str, ...]  # (tokens,)
    top_token_ids: tuple[tuple[int, ...], ...]  # (tokens, k)
    top_logprobs: tuple[tuple[float, ...], ...]  # (tokens, k)
    top_token_texts: tuple[tuple[str, ...], ...]  # (tokens, k)


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """How likely the model found each token of the prompt (vLLM's `prompt_logprobs`).

    `token_ids` and `token_texts` cover the whole prompt (P tokens; the texts join to the decoded
    prompt, special tokens included). The other fields describe prompt tokens 1..P-1 (P-1 entries):
    the first token has no logprob, nothing came before it. Values are the raw log-softmax of the
    logits at the position before each token, as for generated tokens; `ranks[i]` is the token's
    rank in that distribution (1 = most likely); the top k alternatives come most likely first.
    """

    token_ids: tuple[int, ...]  # (P,)
    token_texts: tuple[str, ...]  # (P,)
    logprobs: tuple[float, ...]  # (P-1,)
    ranks: tuple[int, ...]  # (P-1,)
    top_token_ids: tuple[tuple[int, ...], ...]  # (P-1, k)
    top_logprobs: tuple[tuple[float, ...], ...]  # (P-1, k)
    top_token_texts: tuple[tuple[str, ...], ...]  # (P-1, k)


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Where one sequence's time in the engine went, as durations in seconds of the engine's monotonic clock:
    the frontend and the engine may run on different hosts, so no absolute time crosses.

    `queued_s` runs from the sequence joining the engine to its first scheduling, `prefill_s` from there to
    its first token, `decode_s` from there to its finish. A phase the sequence never reached is 0 (a sequence
    aborted while it waited was only queued; an embedding has no decode), so the three add up to its time
    in the engine.
    """

    queued_s: float
    prefill_s: float
    decode_s: float


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one sequence produced in one engine step: the per-step message of the architecture.

    Values are copied when the message is built; `step` counts 0, 1, 2, ... per sequence with no
    gaps so a receiver can detect loss or duplication; `finish_reason` is set exactly once, on the
    sequence's last message; `request_finished` is True on the message that ends the request's last
    unfinished sequence (the Triton adapter sends COMPLETE_FINAL with it). `prompt_logprobs` is set
    on step 0 of every sequence of a request that asked for them (and a token was generated).
    `num_steps` > 1 when a sender that fell behind joined the pending steps `step` .. `step + num_steps - 1`
    of one sequence into one message (backend/coalescing.py; docs/contract.md). `num_cached_tokens` is how many
    prompt tokens had their KV found in the prefix cache when the sequence was admitted (the same on every
    message of the sequence; 0 without a hit). `embedding` is set only on the one message of an embedding
    request (Task.EMBED): the final-norm hidden state of its last prompt token, L2-normalised, with no tokens.
    `timings` is set only on a sequence's last message: where its time in the engine went.
    """

    request_id: str
    seq_index: int
    step: int
    token_ids: tuple[int, ...]
    text_delta: str
    logprobs: TokenLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int  # cumulative for this sequence, at send time
    request_finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    num_steps: int = 1
    num_cached_tokens: int = 0
    embedding: tuple[float, ...] | None = None  # (hidden,)
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """The engine could not go on with a request: every sequence of it ends with this error."""

    request_id: str
    message: str
    error_type: str = "engine_error"  # or "invalid_request_error" (refused before it ran), "overloaded"
    param: str | None = None
    code: str | None = None

    @classmethod
    def refused(cls, request_id: str, error: InvalidRequestError) -> RequestFailure:
        kind = "overloaded" if isinstance(error, EngineOverloaded) else "invalid_request_error"
        return cls(request_id, error.message, kind, error.param, error.code)


EngineOutput = StepOutput | RequestFailure
