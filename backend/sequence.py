"""The one state object of a sequence: `Sequence`, keyed by (request id, sequence index).

A request with n > 1 is n sequences. Sequence 0 is the fork leader: it alone prefills the prompt,
and when it samples for the first time the scheduler forks the others (FORK_PENDING until then)
so they share the prompt's KV blocks and each samples its first token from the leader's logits.

The scheduler reads and advances `num_computed_tokens` and `status`, records `num_cached_tokens` and
`scheduled_at` at the first admission, appends the sampled tokens and frees finished sequences; it
schedules `draft_token_ids` (speculative decoding's proposal, set by the engine after a step:
backend/speculation.py) with the sequence's next decode and clears them. The engine owns the opaque
per-sequence slots (`generator`, `detokenizer`, `stop_matcher`, `next_step`, `finish_reason`, `grammar`,
`logits_inputs`, `prompt_scores`, `prompt_logprobs`, `drafting`, `first_token_at`), which the scheduler
never touches. No torch here.

Its clock readings (`submitted_at`, `scheduled_at`, `first_token_at`: time.monotonic(), each taken once)
become the RequestTimings of its last message (`timings`).
"""

from __future__ import annotations

import enum
import time
from typing import Any

from protocol import FinishReason, RequestTimings, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # in the scheduler's waiting queue (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FORK_PENDING = "fork_pending"  # sibling 1..n-1 waiting for its leader's first sample
    FINISHED = "finished"


class Sequence:
    """Tokens, progress and engine-owned per-sequence state of one sequence.

    Invariant: 0 <= num_computed_tokens <= num_tokens. num_tokens - num_computed_tokens is what
    the sequence still has to run through the model (1 for a decode step).
    """

    __slots__ = (
        "seq_id",
        "request_id",
        "seq_index",
        "prompt_token_ids",
        "output_token_ids",
        "params",
        "bad_words_token_ids",
        "embeds",
        "arrival",
        "num_computed_tokens",
        "num_cached_tokens",
        "status",
        "fork_leader",
        "fork_pending",
        "draft_token_ids",
        "submitted_at",
        "scheduled_at",
        # engine-owned, opaque to the scheduler
        "generator",
        "detokenizer",
        "stop_matcher",
        "next_step",
        "finish_reason",
        "grammar",
        "logits_inputs",
        "prompt_scores",
        "prompt_logprobs",
        "drafting",
        "first_token_at",
    )

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        seq_index: int,
        prompt_token_ids: tuple[int, ...],
        params: SamplingParams,
        arrival: int,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
        embeds: bool = False,
    ) -> None:
        assert len(prompt_token_ids) >= 1, "a sequence needs at least one prompt token"
        self.seq_id = seq_id  # engine-unique; the block manager's key
        self.request_id = request_id
        self.seq_index = seq_index
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.bad_words_token_ids = bad_words_token_ids  # params.bad_words, tokenized (backend/bad_words.py)
        # An embedding request's sequence (Task.EMBED): it runs its prompt, samples nothing, and ends in the
        # step that computes its last prompt token.
        self.embeds = embeds
        self.arrival = arrival  # FCFS order; siblings of one request share it
        self.num_computed_tokens = 0
        # Prompt tokens whose KV came from the prefix cache when the sequence was first admitted (None until
        # then). A readmission after preemption may hit the sequence's own blocks, which the prompt did not.
        self.num_cached_tokens: int | None = None
        self.status = SequenceStatus.WAITING
        self.fork_leader: Sequence | None = None  # set on siblings 1..n-1
        self.fork_pending: list[Sequence] = []  # on the leader: siblings not yet forked
        self.draft_token_ids: tuple[int, ...] = ()  # proposed to follow the last token; verified next decode
        self.submitted_at = time.monotonic()  # joined the engine
        self.scheduled_at: float | None = None  # first admitted from the waiting queue (a fork: its leader's)
        self.generator: Any = None
        self.detokenizer: Any = None
        self.stop_matcher: Any = None
        self.next_step = 0
        self.finish_reason: FinishReason | None = None
        self.grammar: Any = None  # structured_output.GrammarState of a constrained sequence
        self.logits_inputs: Any = None  # logits_processors.FixedInputs, built at its first sampled step
        self.prompt_scores: list[Any] | None = None  # sampler.TokenScore per prompt token 1..P-1, while prefilling
        self.prompt_logprobs: Any = None  # types.PromptLogprobs, built from prompt_scores at the first sample
        self.drafting: Any = None  # speculation.DraftState, when the engine speculates
        self.first_token_at: float | None = None  # its first token sampled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_id_at(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens at positions [start, end) of prompt + output, copied."""
        assert 0 <= start <= end <= self.num_tokens
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return tuple(self.output_token_ids[start - n : end - n])
        return self.prompt_token_ids[start:] + tuple(self.output_token_ids[: end - n])

    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def drop_output_after(self, num_output_tokens: int) -> None:
        """Forget the tokens a step accepted past the one that finished the sequence (it ends now)."""
        del self.output_token_ids[num_output_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def timings(self, finished_at: float) -> RequestTimings:
        """Where its time went, finishing at `finished_at`; a phase it never reached takes no time."""
        scheduled = finished_at if self.scheduled_at is None else self.scheduled_at
        first_token = finished_at if self.first_token_at is None else self.first_token_at
        return RequestTimings(scheduled - self.submitted_at, first_token - scheduled, finished_at - first_token)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id!r}#{self.seq_index}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
