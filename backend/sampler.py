"""Sampler: one next token per sequence from the model's logits, plus its logprobs.

`Sampler.sample(logits (S, V) fp32, rows)` treats row i of `logits` with `rows[i]` and returns one
`SampledToken` per row, as plain Python values. The pipeline follows vLLM V1:

    raw logits ──► logprobs (raw log_softmax, only rows that asked)
        │
        ├─ logits processors and grammar masks (backend/logits_processors.py)
        ▼
    greedy rows (temperature < 1e-5): argmax
    other rows: / temperature ─► min_p ─► top_k ─► top_p ─► draw one token

Logprobs are the model's raw distribution (`log_softmax` of the unprocessed logits over the full
vocabulary, vLLM's `raw_logprobs`): temperature, penalties, top-k/top-p and logit_bias never change
them. The sampled token's entry is always there; `params.logprobs = k` adds the k most likely tokens (a beam
search row gets its 2n candidates: `SamplingParams.num_top_logprobs`).

A row's draw comes only from its own `torch.Generator` (`make_generator`), so a seeded row picks the
same token whatever other rows share the batch; rows without one share a batched draw from torch's
global RNG. The draw is inverse-CDF sampling with one float64 uniform per row, in two levels (a block
of 256 tokens, then a token inside it) so that float32 sums never swallow small probabilities; vLLM's
exponential race would draw V numbers per row. Everything else is vectorized over the batch.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from backend.logits_processors import FixedInputs, apply_grammar, apply_logits_processors
from backend.structured_output import TokenBitmask
from kernels import cpu_kernels
from protocol import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as vLLM's _SAMPLING_EPS)
_CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
# top-p looks for the nucleus among this many most likely tokens per row, in turn, and sorts the
# whole vocabulary only for rows whose nucleus is larger (see _top_p_floor).
_TOP_P_CANDIDATES = (64, 1024)


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs to know about one sequence for one step."""

    params: SamplingParams
    generator: torch.Generator | None  # None: torch's global RNG (not reproducible)
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    eos_token_ids: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences
    fixed: FixedInputs | None = None  # the sequence's fixed processor inputs as tensors (None: built per call)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token; the logprob fields are filled only when params.logprobs is not None."""

    token_id: int
    logprob: float | None = None  # raw log_softmax of the sampled token
    top_token_ids: tuple[int, ...] = ()  # the params.logprobs most likely tokens, most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True, slots=True)
class TokenScore:
    """How likely the model found a given token (a prompt token) at one position."""

    logprob: float  # raw log_softmax of the token
    rank: int  # 1 + the number of tokens the model found more likely
    top_token_ids: tuple[int, ...] = ()  # the k most likely tokens at the position, most likely first
    top_logprobs: tuple[float, ...] = ()


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenScore]:
    """logits (R, V) of R positions, token_ids (R,) the token that followed each -> one TokenScore per row.

    Same arithmetic as the sampled tokens' logprobs (`_with_logprobs`), so a token that is the most
    likely has exactly the logprob of the top-1 alternative.
    """
    raw = logits.float()  # (R, V)
    log_norm = _log_norm(raw)  # (R, 1)
    chosen = raw.gather(1, token_ids[:, None])  # (R, 1)
    logprobs = (chosen - log_norm).squeeze(1).tolist()  # (R,)
    ranks = ((raw > chosen).sum(dim=1, dtype=torch.int32) + 1).tolist()  # (R,); int32: bools summed into int64 are slow
    k = min(k, raw.shape[1])
    if k == 0:
        return [TokenScore(lp, rank) for lp, rank in zip(logprobs, ranks)]
    top_values, top_indices = raw.topk(k, dim=-1)  # (R, k), most likely first
    top_values, top_indices = (top_values - log_norm).tolist(), top_indices.tolist()
    return [
        TokenScore(lp, rank, tuple(ids), tuple(values))
        for lp, rank, ids, values in zip(logprobs, ranks, top_indices, top_values)
    ]


def make_generator(seed: int | None, seq_index: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The random stream of sequence `seq_index` of a request.

    seed None: a fresh random seed from os.urandom. Otherwise a hash of (seed, seq_index), so the n
    siblings of one seeded request get distinct streams that are the same on every run; any Python
    int is accepted as seed (negative, or wider than 64 bits).
    """
    if seed is None:
        value = int.from_bytes(os.urandom(8), "little")
    else:
        digest = hashlib.blake2b(f"{seed}:{seq_index}".encode(), digest_size=8, person=b"llm-sampler").digest()
        value = int.from_bytes(digest, "little")
    generator = torch.Generator(device=device)
    generator.manual_seed(value)
    return generator


class Sampler:
    """Stateless: everything a step needs comes in the rows."""

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], allowed: TokenBitmask | None = None
    ) -> list[SampledToken]:
        """allowed: the grammar masks of the constrained rows (None: no row is constrained)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be (len(rows), vocab); got {tuple(logits.shape)} for {len(rows)} rows")
        if not rows:
            return []
        raw = logits.float()  # (S, V); never modified
        processed = apply_logits_processors(raw, rows)  # (S, V); `raw` itself when no row needs processing
        if allowed is not None:
            processed = apply_grammar(raw, processed, allowed)
        token_ids = _choose_tokens(processed, rows)  # (S,) int64
        return _with_logprobs(raw, token_ids, rows)


# ---------------------------------------------------------------- choosing the token


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits (S, V) -> (S,) int64, as torch.argmax(dim=-1); on CPU fp32 the C++ op where built (torch's
    reduction is one thread a row)."""
    if (ops := cpu_kernels.layer_ops_for(logits)) is not None:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _choose_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """(S,) int64: argmax for greedy rows, a random draw for the others."""
    is_random = [row.params.temperature >= GREEDY_EPS for row in rows]
    random_rows = [i for i, r in enumerate(is_random) if r]
    if not random_rows:
        return _argmax(logits)
    device = logits.device
    all_random = len(random_rows) == len(rows)
    sel = torch.tensor(random_rows, device=device)
    params = [rows[i].params for i in random_rows]
    weights = _filtered_weights(logits.clone() if all_random else logits[sel], params)  # (R, V)
    uniforms = _draw_uniforms([rows[i].generator for i in random_rows], device)  # (R,)
    drawn = _inverse_cdf(weights, uniforms)  # (R,)
    if all_random:
        return drawn
    greedy_rows = torch.tensor([i for i, r in enumerate(is_random) if not r], device=device)
    tokens = torch.empty(len(rows), dtype=torch.int64, device=device)  # (S,)
    tokens[greedy_rows] = _argmax(logits[greedy_rows])
    tokens[sel] = drawn
    return tokens


def _filtered_weights(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Turns x (R, V), a private copy of the logits, in place into the unnormalized probabilities
    softmax(x / temperature) * const after min_p, top_k and top_p (0 = dropped).

    The weights are exp(x / T - max), so the top token weighs 1 and each filter is a per-row floor
    on the weights (ties with the floor are kept):
    - min_p: p_i >= min_p * p_max, i.e. w_i >= min_p
    - top_k: w_i >= the k-th largest weight
    - top_p (after the others, on their renormalized distribution): the smallest set of most likely
      tokens whose mass reaches p; a token is kept when the mass ranked above it is below p (vLLM's
      rule), so the top token always stays.
    In-place work on one buffer: on CPU an out-of-place (R, V) op costs several in-place ones.
    """
    R, V = x.shape
    device = x.device
    x.div_(torch.tensor([p.temperature for p in params], device=device)[:, None])
    weights = x.sub_(x.amax(dim=-1, keepdim=True)).exp_()  # (R, V), max 1
    floor = torch.tensor([p.min_p for p in params], device=device)[:, None]  # (R, 1)
    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < V]
    if k_rows:
        r = torch.tensor(k_rows, device=device)
        k = torch.tensor([params[i].top_k for i in k_rows], device=device)[:, None]  # (K, 1)
        kth = weights[r].topk(int(k.max()), dim=-1).values.gather(1, k - 1)  # (K, 1): each row's k-th largest
        floor[r] = torch.maximum(floor[r], kth)
    if k_rows or any(p.min_p > 0.0 for p in params):
        _drop_below(weights, floor)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        top_p = torch.tensor([params[i].top_p for i in p_rows], dtype=torch.float64, device=device)[:, None]  # (P, 1)
        if len(p_rows) == R:
            _drop_below(weights, _top_p_floor(weights, top_p))
        else:
            r = torch.tensor(p_rows, device=device)
            sub = weights[r]  # (P, V), a copy
            weights[r] = _drop_below(sub, _top_p_floor(sub, top_p))
    return weights


def _drop_below(weights: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """weights (R, V) *= (weights >= floor (R, 1)), in place.

    Spelled sign(w - floor) + 1, clamped to 1: float ops only, about twice as fast on CPU as
    building a bool mask and multiplying by it.
    """
    return weights.mul_((weights - floor).sign_().add_(1.0).clamp_(max=1.0))


def _top_p_floor(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(P, 1): the weight of the least likely token of each row's nucleus; weights (P, V), top_p (P, 1).

    The nucleus is first sought among each row's 64 most likely tokens, then 1024; only rows whose
    nucleus is wider than that sort the whole vocabulary (~20x the cost of a small topk on CPU).
    """
    V = weights.shape[1]
    total = weights.sum(dim=-1, keepdim=True, dtype=torch.float64)  # (P, 1)
    out = torch.zeros_like(weights[:, :1])  # (P, 1)
    pending = torch.arange(weights.shape[0], device=weights.device)
    for candidates in (*_TOP_P_CANDIDATES, V):
        k = min(candidates, V)
        rows = weights if pending.numel() == weights.shape[0] else weights[pending]  # (P', V)
        values = rows.topk(k, dim=-1).values  # (P', k), descending
        probs = values.double() / total[pending]  # (P', k)
        cumulative = probs.cumsum(dim=-1)  # (P', k)
        p = top_p[pending]  # (P', 1)
        kept = ((cumulative - probs) < p).sum(dim=-1, keepdim=True).clamp_(min=1)  # (P', 1), a prefix
        found = (cumulative[:, -1:] >= p).squeeze(1) | (k == V)  # (P',): the nucleus ends in here
        out[pending[found]] = values.gather(1, kept - 1)[found]
        pending = pending[~found]
        if not pending.numel():
            break
    return out


def _draw_uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """(R,) float64 uniforms in [0, 1): one from each row's own generator, one batch for the rest."""
    u = torch.empty(len(generators), dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=g, device=g.device).item()
    return u.to(device)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(R,) int64: for each row the token where the CDF of `weights` (R, V) passes u (R,).

    Two levels so that float32 sums never swallow small probabilities: block masses (256 tokens
    each) are accumulated in float64 to pick a block, then the CDF inside that block picks the
    token. A token with weight 0 is never picked: searchsorted(right=True) returns the first
    position whose cumulative mass is strictly above the target, and the target stays below the
    total.
    """
    R, V = weights.shape
    pad = -V % _CDF_BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    blocks = weights.view(R, -1, _CDF_BLOCK)  # (R, NB, B)
    block_mass = blocks.sum(dim=-1, dtype=torch.float64)  # (R, NB)
    block_cdf = block_mass.cumsum(dim=-1)  # (R, NB)
    target = _below(u[:, None] * block_cdf[:, -1:], block_cdf[:, -1:])  # (R, 1)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # (R, 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # (R, 1)
    fraction = (target - before) / block_mass.gather(1, block)  # (R, 1) in [0, 1)
    inner = blocks[torch.arange(R, device=weights.device), block.squeeze(1)].double().cumsum(dim=-1)  # (R, B)
    offset = torch.searchsorted(inner, _below(fraction * inner[:, -1:], inner[:, -1:]), right=True)  # (R, 1)
    # the clamps only matter for NaN weights (NaN logits): a wrong token rather than a crashed batch
    return (block * _CDF_BLOCK + offset.clamp_(max=_CDF_BLOCK - 1)).squeeze(1).clamp_(max=V - 1)


def _below(value: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """min(value, the largest float below total): guards u * total against rounding up to total."""
    return torch.minimum(value, torch.nextafter(total, torch.zeros_like(total)))


# ---------------------------------------------------------------- logprobs and results


def _log_norm(logits: torch.Tensor) -> torch.Tensor:
    """(R, 1) fp32 logsumexp of each row of logits (R, V), the same bits whatever rows share the batch.

    torch's fp32 reduction sums a lone row in another order than a row among others (it splits it over
    threads); the C++ op sums every row on one thread, and without it each row is reduced alone.
    """
    if (ops := cpu_kernels.layer_ops_for(logits)) is not None:
        return ops.logsumexp_rows(logits)[:, None]
    return torch.stack([row.logsumexp(dim=-1) for row in logits])[:, None] if logits.shape[0] else logits[:, :1]


def _with_logprobs(raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    ids = token_ids.tolist()
    wanted = [i for i, row in enumerate(rows) if row.params.num_top_logprobs is not None]
    if not wanted:
        return [SampledToken(token_id=t) for t in ids]
    # log_softmax(raw) = raw - logsumexp(raw), evaluated only where needed (no (L, V) result)
    if len(wanted) == len(rows):
        sub, tokens = raw, token_ids
    else:
        sel = torch.tensor(wanted, device=raw.device)
        sub, tokens = raw[sel], token_ids[sel]  # (L, V), (L,)
    log_norm = _log_norm(sub)  # (L, 1)
    sampled = (sub.gather(1, tokens[:, None]) - log_norm).squeeze(1).tolist()  # (L,)
    ks = [rows[i].params.num_top_logprobs for i in wanted]  # (validated: at most MAX_LOGPROBS, or 2 beam widths)
    k_max = min(max(ks), raw.shape[1])
    if k_max > 0:
        top_values, top_indices = sub.topk(k_max, dim=-1)  # (L, k_max), most likely first
        top_values, top_indices = (top_values - log_norm).tolist(), top_indices.tolist()
    out = [SampledToken(token_id=t) for t in ids]
    for j, (i, k) in enumerate(zip(wanted, ks)):
        out[i] = SampledToken(
            token_id=ids[i],
            logprob=sampled[j],
            top_token_ids=tuple(top_indices[j][:k]) if k else (),
            top_logprobs=tuple(top_values[j][:k]) if k else (),
        )
    return out
