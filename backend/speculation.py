"""Speculative decoding's drafts: n-gram prompt lookup, and how many tokens each sequence drafts.

A decoding sequence whose last tokens (an n-gram, n from `ngram_max` down to `ngram_min`) occurred
earlier in its prompt or output proposes the tokens that followed that occurrence (vLLM's `ngram`,
llama.cpp's lookup decoding). The next step computes them as extra query rows; the sampler keeps each
drafted token only where it is exactly the token plain decoding would have chosen there
(backend/model_runner.py), so speculation changes the speed of a sequence, never its tokens.

How many to draft is decided per sequence and step, as a bet on cost: a query row costs about
`row_cost` of a step's fixed cost, so with B sequences decoding, one drafted token pays when it is
accepted with a probability above B r / (1 + B r). Each sequence keeps an estimate of its per-token
acceptance (a moving average); draft j is proposed while acceptance^(j+1) clears that bar. A sequence
whose drafts keep failing stops drafting, and its estimate drifts back toward the prior while it does
not draft, so it tries again now and then. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.sequence import Sequence

PRIOR_ACCEPTANCE = 0.8  # the estimate of a sequence that has not drafted yet
LEARNING_RATE = 0.25  # weight of each judged draft token in the moving average
RECOVERY_RATE = 0.02  # per step without drafting, the estimate moves this share of the way back to the prior


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    num_speculative_tokens: int  # at most this many drafted tokens per sequence and step
    ngram_min: int
    ngram_max: int
    row_cost: float  # one query row's cost / a step's fixed cost (compute-bound CPU steps: about 0.5)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if self.row_cost < 0:
            raise ValueError("speculative_row_cost must be >= 0")


class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended, for n in [n_min, n_max]; grows with the tokens.

    `propose` indexes every n-gram that ends before the last token, then looks up the sequence's own
    suffix, longest n first, and returns what followed its latest earlier occurrence; where that runs
    into the suffix, the tokens in between repeat (a loop continues).
    """

    __slots__ = ("_n_min", "_n_max", "_tokens", "_ends", "_indexed")

    def __init__(self, n_min: int, n_max: int) -> None:
        self._n_min, self._n_max = n_min, n_max
        self._tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]
        self._indexed = 0  # n-grams ending (exclusive) at positions below this are in _ends

    def propose(self, seq: Sequence, k: int) -> tuple[int, ...]:
        tokens = self._tokens
        if len(tokens) < seq.num_tokens:
            tokens.extend(seq.token_slice(len(tokens), seq.num_tokens))
        L = len(tokens)
        n_min, n_max, ends = self._n_min, self._n_max, self._ends
        for end in range(max(self._indexed, n_min), L):  # the suffix itself (end == L) stays out
            for n in range(n_min, min(n_max, end) + 1):
                ends[n - n_min][tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, L)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            end = ends[n - n_min].get(tuple(tokens[L - n :]))
            if end is not None:
                drafts = tokens[end : end + k]
                period = L - end  # where the continuation reaches the suffix, the text repeats with this period
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - period])
                return tuple(drafts)
        return ()


class DraftState:
    """One sequence's drafting: its n-gram index and its acceptance estimate."""

    __slots__ = ("index", "acceptance")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.index = NgramIndex(n_min, n_max)
        self.acceptance = PRIOR_ACCEPTANCE


class NgramSpeculator:
    """Proposes each decoding sequence's drafts after a step and learns from the next step's verdict."""

    def __init__(self, config: SpeculationConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    def judge(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        """The step verified `num_drafted` tokens of seq and kept the first `num_accepted`."""
        state = self._state(seq)
        judged = min(num_drafted, num_accepted + 1)  # tokens after the first rejection were never judged
        for j in range(judged):
            state.acceptance += LEARNING_RATE * ((j < num_accepted) - state.acceptance)

    def propose(self, seq: Sequence, num_decoding: int) -> tuple[int, ...]:
        """seq's drafts for its next step (seq has just sampled, and runs on); `num_decoding`: the
        sequences decoding this step."""
        params = seq.params
        room = self.max_model_len - seq.num_tokens - 1  # each drafted token and the one after it fit
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        state = self._state(seq)
        k = min(self.config.num_speculative_tokens, room, self._worthwhile(state.acceptance, num_decoding))
        if k <= 0:
            state.acceptance += RECOVERY_RATE * (PRIOR_ACCEPTANCE - state.acceptance)
            return ()
        return state.index.propose(seq, k)

    def _worthwhile(self, acceptance: float, num_decoding: int) -> int:
        """How many drafted tokens pay: the largest j with acceptance^j above the bar (0: none)."""
        cost = self.config.row_cost * max(1, num_decoding)
        bar = cost / (1.0 + cost)
        j, p = 0, acceptance
        while j < self.config.num_speculative_tokens and p > bar:
            j += 1
            p *= acceptance
        return j

    def _state(self, seq: Sequence) -> DraftState:
        if seq.drafting is None:
            seq.drafting = DraftState(self.config.ngram_min, self.config.ngram_max)
        return seq.drafting
