"""The logits processors: what a row's settings do to its logits before temperature and sampling.

In vLLM V1's order, on a copy of the raw logits (S, V):

    min_tokens: EOS ids and stop_token_ids get -inf while len(output) < min_tokens
    bad_words: a token that would complete one gets -inf (backend/bad_words.py)
    logit_bias: added to the logits
    repetition_penalty (prompt + output tokens): positive logits / p, negative logits * p
    frequency / presence penalty (output tokens): - f * count - p * (count > 0)
    allowed_token_ids: every other token gets -inf (where min_tokens or bad_words banned all the allowed
        ones, the row samples the allowed ones from their raw logits)
    structured outputs (`apply_grammar`): tokens the row's grammar forbids get -inf; where the others left
        a constrained row nothing (min_tokens banning the EOS its grammar requires), the grammar wins and
        the row is masked from its raw logits

`ignore_eos` leaves EOS ids unmasked for min_tokens: they would not stop the sequence anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING

import torch

from backend.bad_words import banned_next_tokens
from backend.structured_output import TokenBitmask

if TYPE_CHECKING:
    from backend.sampler import SamplingRow
    from protocol import SamplingParams


class FixedInputs:
    """A sequence's logits-processor inputs that never change (its params' token lists and the EOS ids)
    as tensors, built at its first step and kept: a step then costs a few tensor operations per row, not
    Python work over lists of up to thousands of ids."""

    __slots__ = ("_params", "_eos_token_ids", "_built")

    def __init__(self, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> None:
        self._params, self._eos_token_ids = params, eos_token_ids
        self._built: _FixedTensors | None = None

    def tensors(self, vocab: int, device: torch.device) -> _FixedTensors:
        built = self._built
        if built is None or built.vocab != vocab or built.device != device:
            built = self._built = _FixedTensors.build(self._params, self._eos_token_ids, vocab, device)
        return built


@dataclass(frozen=True, slots=True)
class _FixedTensors:
    """Ids past the vocabulary are left out: they are never sampled anyway, and the engine refuses them
    before a request runs, so nothing here fails a whole batch."""

    vocab: int
    device: torch.device
    min_tokens_banned: torch.Tensor | None  # (M,) int64: banned while the output is shorter than min_tokens
    bias_ids: torch.Tensor | None  # (B,) int64, each id once (logit_bias comes from a dict)
    bias_values: torch.Tensor | None  # (B,) fp32
    disallowed: torch.Tensor | None  # (V,) bool: every token but allowed_token_ids (None: all allowed)

    @classmethod
    def build(
        cls, params: SamplingParams, eos_token_ids: tuple[int, ...], vocab: int, device: torch.device
    ) -> _FixedTensors:
        def ids(values) -> torch.Tensor:
            return torch.tensor(sorted(t for t in set(values) if t < vocab), dtype=torch.int64, device=device)

        banned = None
        if params.min_tokens > 0:
            banned = ids(params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *eos_token_ids))
        bias = [(t, b) for t, b in params.logit_bias if t < vocab]
        return cls(
            vocab,
            device,
            banned if banned is not None and banned.numel() else None,
            torch.tensor([t for t, _ in bias], dtype=torch.int64, device=device) if bias else None,
            torch.tensor([b for _, b in bias], dtype=torch.float32, device=device) if bias else None,
            _disallowed(ids(params.allowed_token_ids), vocab, device) if params.allowed_token_ids is not None else None,
        )


def apply_logits_processors(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens mask, bad_words, logit_bias, penalties and allowed_token_ids; a new tensor, or `raw`
    itself when nothing applies.

    All but the last touch only a few entries per row (the banned ids, the biased ids, the tokens seen so
    far), so they work on flat indices `row * V + token` rather than on dense (S, V) masks; the fixed ids
    come from each row's FixedInputs.
    """
    S, V = raw.shape
    device = raw.device
    banned: list[torch.Tensor] = []  # flat indices set to -inf for min_tokens and bad_words
    bias_at: list[torch.Tensor] = []  # flat indices and values of logit_bias
    bias_values: list[torch.Tensor] = []
    rep_rows: list[int] = []  # rows with repetition_penalty != 1
    pen_rows: list[int] = []  # rows with a frequency or presence penalty
    only_rows: list[int] = []  # rows with allowed_token_ids
    disallowed: list[torch.Tensor] = []  # their (V,) masks of the other tokens
    for i, row in enumerate(rows):
        p = row.params
        fixed = (row.fixed or FixedInputs(p, row.eos_token_ids)).tensors(V, device)
        if fixed.min_tokens_banned is not None and len(row.output_token_ids) < p.min_tokens:
            banned.append(fixed.min_tokens_banned + i * V)
        if row.bad_words_token_ids:
            words = [i * V + t for t in banned_next_tokens(row.bad_words_token_ids, row.output_token_ids) if t < V]
            if words:
                banned.append(torch.tensor(words, dtype=torch.int64, device=device))
        if fixed.bias_ids is not None:
            bias_at.append(fixed.bias_ids + i * V)
            bias_values.append(fixed.bias_values)
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            pen_rows.append(i)
        if fixed.disallowed is not None:
            only_rows.append(i)
            disallowed.append(fixed.disallowed)
    if not (banned or bias_at or rep_rows or pen_rows or only_rows):
        return raw

    out = raw.clone()  # (S, V)
    flat = out.view(-1)  # (S * V,)
    if banned:
        flat[torch.cat(banned)] = -math.inf
    if bias_at:  # each token once per row, so no accumulate needed
        flat[torch.cat(bias_at)] += torch.cat(bias_values)
    if rep_rows:
        seen_tokens = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep_rows]
        at, _ = _occurrences(rep_rows, seen_tokens, V, device)
        penalty = _per_row(S, rep_rows, [rows[i].params.repetition_penalty for i in rep_rows], device)[at // V]
        seen = flat[at]
        flat[at] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if pen_rows:
        at, counts = _occurrences(pen_rows, [rows[i].output_token_ids for i in pen_rows], V, device)
        frequency = _per_row(S, pen_rows, [rows[i].params.frequency_penalty for i in pen_rows], device)[at // V]
        presence = _per_row(S, pen_rows, [rows[i].params.presence_penalty for i in pen_rows], device)[at // V]
        flat[at] -= frequency * counts + presence
    for i, others in zip(only_rows, disallowed):  # (in place, row by row: cheaper than stacking masks)
        row = out[i].masked_fill_(others, -math.inf)  # (V,)
        if not bool((row > -math.inf).any()):  # min_tokens / bad_words banned all allowed: they win, raw
            row.copy_(raw[i]).masked_fill_(others, -math.inf)
    return out


def _disallowed(allowed: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor | None:
    """(V,) bool, True but at `allowed`; None when none of them is in the vocabulary (the row is left
    as it is rather than given nothing to sample)."""
    if allowed.numel() == 0:
        return None
    mask = torch.ones(vocab, dtype=torch.bool, device=device)
    mask[allowed] = False
    return mask


def apply_grammar(raw: torch.Tensor, processed: torch.Tensor, allowed: TokenBitmask) -> torch.Tensor:
    """processed (S, V) with each constrained row masked by its grammar; a private copy of raw if needed."""
    out = raw.clone() if processed is raw else processed
    allowed.apply(out)
    rows = torch.tensor(allowed.rows)
    dead = rows[out[rows].amax(dim=-1) == -math.inf].tolist()  # rows the processors left nothing to pick
    if dead:
        out[dead] = raw[dead]
        allowed.apply(out, dead)
    return out


def _occurrences(
    row_ids: list[int], token_lists: list[tuple[int, ...]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct flat indices `row * vocab + token` of the tokens in each row's list, and their counts."""
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64, device=device)
    owner = torch.repeat_interleave(torch.tensor(row_ids, device=device), lengths)
    keep = tokens < vocab
    at, counts = torch.unique(owner[keep] * vocab + tokens[keep], return_counts=True)
    return at, counts.float()


def _per_row(num_rows: int, row_ids: list[int], values: list[float], device: torch.device) -> torch.Tensor:
    """(num_rows,) fp32 with values at row_ids, zero elsewhere."""
    out = torch.zeros(num_rows, device=device)
    out[torch.tensor(row_ids, device=device)] = torch.tensor(values, device=device)
    return out
