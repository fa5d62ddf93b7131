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
from itertools import chain
from typing import TYPE_CHECKING

import torch

from backend.bad_words import banned_next_tokens
from backend.structured_output import TokenBitmask

if TYPE_CHECKING:
    from backend.sampler import SamplingRow


def apply_logits_processors(raw: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """min_tokens mask, bad_words, logit_bias, penalties and allowed_token_ids; a new tensor, or `raw`
    itself when nothing applies.

    All but the last touch only a few entries per row (the banned ids, the biased ids, the tokens seen so
    far), so they work on flat indices `row * V + token` rather than on dense (S, V) masks.
    """
    S, V = raw.shape
    banned: list[int] = []  # flat indices set to -inf for min_tokens and bad_words
    bias_at: list[int] = []  # flat indices and values of logit_bias
    bias_values: list[float] = []
    rep_rows: list[int] = []  # rows with repetition_penalty != 1
    pen_rows: list[int] = []  # rows with a frequency or presence penalty
    only_rows: list[int] = []  # rows with allowed_token_ids
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) < p.min_tokens:
            ids = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(row.eos_token_ids)
            banned.extend(i * V + t for t in ids if t < V)  # ids past the vocabulary are never sampled anyway
        if row.bad_words_token_ids:
            banned.extend(i * V + t for t in banned_next_tokens(row.bad_words_token_ids, row.output_token_ids) if t < V)
        for t, b in p.logit_bias:
            if t < V:  # the frontend validates against the vocabulary; never fail a whole batch here
                bias_at.append(i * V + t)
                bias_values.append(b)
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            pen_rows.append(i)
        if p.allowed_token_ids is not None:
            only_rows.append(i)
    if not (banned or bias_at or rep_rows or pen_rows or only_rows):
        return raw

    device = raw.device
    out = raw.clone()  # (S, V)
    flat = out.view(-1)  # (S * V,)
    if banned:
        flat[torch.tensor(banned, device=device)] = -math.inf
    if bias_at:  # each token once per row (logit_bias comes from a dict), so no accumulate needed
        flat[torch.tensor(bias_at, device=device)] += torch.tensor(bias_values, device=device)
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
    for i in only_rows:
        ids = torch.tensor([t for t in rows[i].params.allowed_token_ids if t < V], dtype=torch.long, device=device)
        if ids.numel() == 0:  # (the engine refuses ids past the vocabulary; never fail a whole batch here)
            continue
        kept = out[i, ids]
        if not bool((kept > -math.inf).any()):  # min_tokens / bad_words banned all allowed: they win, raw
            kept = raw[i, ids]
        out[i] = -math.inf
        out[i, ids] = kept
    return out


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
