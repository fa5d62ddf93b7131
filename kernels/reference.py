"""Pure-torch references for the paged KV-cache kernels (and the rotary embedding applied before the
store, which the model and the CPU rope + store op's reference share).

These are both the ground truth the Triton kernels are tested against and the engine's CPU
serving path, so they are vectorized where it matters (decode runs every step for every
sequence) and never loop over tokens.

Cache layout (one layer): k_cache, v_cache: (num_blocks, block_size, KVH, D).
Slot of a token = block_id * block_size + offset_in_block.
GQA: query head h uses KV head h // G, G = H // KVH.
Softmax is computed in fp32; outputs come back in q's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: x (T, heads, D), cos/sin (T, 1, D) as backend.layers.rope_tables gives them
    (sin's first half negated) -> x * cos + roll_half(x) * sin, (T, heads, D)."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # (T, heads, D): (x2, x1)
    return torch.addcmul(x * cos, rolled, sin)  # (T, heads, D)


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    all_slots_valid: bool = False,
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t]; a negative slot skips row t.

    k, v: (T, KVH, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); slot_mapping: (T,) int64.
    all_slots_valid: the caller checked once per step that no slot is negative (saves a check per layer).
    Writes in place (works for any cache strides).
    """
    slots = slot_mapping.to(device=k.device, dtype=torch.long)  # (T,)
    if not all_slots_valid:
        keep = slots >= 0  # (T,)
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]  # (T', ...)
    if slots.numel() == 0:
        return
    NB, BS, KVH, D = k_cache.shape
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        # One row copy per token into the flat (slots, KVH, D) view: a third of fancy indexing's cost.
        k_cache.view(NB * BS, KVH, D).index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.view(NB * BS, KVH, D).index_copy_(0, slots, v.to(v_cache.dtype))
        return
    blocks, offsets = slots // BS, slots % BS  # (T',), (T',)
    k_cache[blocks, offsets] = k.to(k_cache.dtype)  # (T', KVH, D) into (NB, BS, KVH, D)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(NB, BS, KVH, D) cache, (B, nb) int64 table -> (B, nb * BS, KVH, D) contiguous context."""
    B, nb = table.shape
    NB, BS, KVH, D = cache.shape
    if cache.is_contiguous():
        # index_select on whole blocks is a plain row copy, much faster on CPU than fancy indexing.
        ctx = cache.view(NB, BS * KVH * D).index_select(0, table.reshape(-1))  # (B*nb, BS*KVH*D)
    else:
        ctx = cache[table]  # (B, nb, BS, KVH, D)
    return ctx.view(B, nb * BS, KVH, D)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Where each decode sequence's context sits in the flattened cache; the same for every layer
    of a step, so it is built once per step (AttentionMetadata does) instead of once per layer."""

    slots: torch.Tensor  # (B, L) int64: cache slot of each context position (zero_slot where invalid)
    valid: torch.Tensor  # (B, L) bool: position < seq_lens[b]
    reads_zeros: bool  # invalid positions read a slot known to hold zeros: no masking of K/V needed
    all_valid: bool  # every context has length L (always so at batch 1): attention needs no mask


def decode_plan(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, zero_slot: int | None = None
) -> DecodePlan:
    """block_tables (B, max_blocks) int32, seq_lens (B,) int32 -> the slots of positions [0, max(seq_lens)).

    zero_slot: a cache slot that is never written (the engine keeps a null block for this); invalid
    positions then read it instead of stale data, which saves masking the gathered K/V.
    """
    L = int(seq_lens.max()) if seq_lens.numel() else 0
    all_valid = int(seq_lens.min()) == L if seq_lens.numel() else True
    pos = torch.arange(L, device=block_tables.device)  # (L,)
    valid = pos[None, :] < seq_lens.to(torch.long)[:, None]  # (B, L)
    blocks = block_tables.to(torch.long).gather(1, (pos // block_size).expand(len(seq_lens), L))  # (B, L)
    slots = torch.where(valid, blocks * block_size + pos % block_size, zero_slot or 0)  # (B, L)
    return DecodePlan(slots=slots, valid=valid, reads_zeros=zero_slot is not None, all_valid=all_valid)


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    plan: DecodePlan | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q: (B, H, D); k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, max_blocks) int32;
    seq_lens: (B,) int32, each >= 1 (the query sits at position seq_lens[b] - 1).
    plan: the step's DecodePlan, if the caller built it once for all layers.
    Returns (B, H, D) in q's dtype. Vectorized over the batch: every context is gathered to the
    longest one's length (one index_select per K and V) and positions >= seq_lens[b] are masked.
    """
    B, H, D = q.shape
    NB, BS, KVH = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    if B == 0:
        return q.new_empty(B, H, D)
    plan = plan or decode_plan(block_tables, seq_lens, BS)
    L = plan.slots.shape[1]
    index = plan.slots.reshape(-1)  # (B*L,)
    k = k_cache.reshape(NB * BS, KVH, D).index_select(0, index).view(B, L, KVH, D)  # (B, L, KVH, D)
    v = v_cache.reshape(NB * BS, KVH, D).index_select(0, index).view(B, L, KVH, D)  # (B, L, KVH, D)
    # Slots past seq_lens hold stale data (maybe NaN from torch.empty): NaN survives both the
    # additive mask and a zero attention weight, so clear them in the gathered copies.
    # A compiled graph always masks: branching on all_valid would compile one more graph per batch size.
    masked = torch.compiler.is_compiling() or not plan.all_valid
    if not plan.reads_zeros and masked:
        invalid = ~plan.valid[:, :, None, None]  # (B, L, 1, 1)
        k.masked_fill_(invalid, 0.0)
        v.masked_fill_(invalid, 0.0)
    # (.float() is free for fp32 caches.)
    qg = q.reshape(B, KVH, G, D).float()  # (B, KVH, G, D): the G query heads of a KV head together
    out = F.scaled_dot_product_attention(
        qg,
        k.transpose(1, 2).float(),  # (B, KVH, L, D)
        v.transpose(1, 2).float(),  # (B, KVH, L, D)
        attn_mask=plan.valid[:, None, None, :] if masked else None,  # (B, 1, 1, L)
        scale=scale,
    )  # (B, KVH, G, D)
    return out.reshape(B, H, D).to(q.dtype)  # (B, H, D)


def paged_prefill_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Ragged causal attention of new query tokens over cached prefix + themselves.

    q: (T, H, D); k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, max_blocks) int32;
    query_start_loc: (B+1,) int32, sequence b owns rows [qsl[b], qsl[b+1]);
    seq_lens: (B,) int32, context length including these queries (their K/V are already stored).
    Query i of sequence b (q_len rows) sits at position seq_lens[b] - q_len + i and attends to
    positions <= its own. Returns (T, H, D) in q's dtype.
    """
    H, D = q.shape[1], q.shape[2]
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    out = torch.empty_like(q)  # (T, H, D)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, ctx_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        q_len = hi - lo
        if q_len == 0:
            continue
        nb = -(-ctx_len // block_size)
        table = block_tables[b : b + 1, :nb].to(device=k_cache.device, dtype=torch.long)  # (1, nb)
        k = _gather_context(k_cache, table)[0, :ctx_len]  # (ctx, KVH, D)
        v = _gather_context(v_cache, table)[0, :ctx_len]  # (ctx, KVH, D)
        k = k.permute(1, 0, 2).float()  # (KVH, ctx, D)
        v = v.permute(1, 0, 2).float()  # (KVH, ctx, D)
        # Fold the G query heads of each KV head into the query-length axis: no K/V repeat.
        qb = q[lo:hi].reshape(q_len, KVH, G, D).permute(1, 2, 0, 3)  # (KVH, G, q_len, D)
        qb = qb.reshape(KVH, G * q_len, D).float()  # (KVH, G*q_len, D)
        qpos = torch.arange(q_len, device=q.device) + (ctx_len - q_len)  # (q_len,)
        kpos = torch.arange(ctx_len, device=q.device)  # (ctx,)
        allowed = kpos[None, :] <= qpos[:, None]  # (q_len, ctx) causal with prefix offset
        allowed = allowed.repeat(G, 1)  # (G*q_len, ctx)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=allowed, scale=scale)  # (KVH, G*q_len, D)
        o = o.reshape(KVH, G, q_len, D).permute(2, 0, 1, 3).reshape(q_len, H, D)  # (q_len, H, D)
        out[lo:hi] = o.to(q.dtype)
    return out
