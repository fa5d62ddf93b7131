"""Pure-torch references for the paged KV-cache kernels.

These are both the ground truth the Triton kernels are tested against and the engine's CPU
serving path, so they are vectorized where it matters (decode runs every step for every
sequence) and never loop over tokens.

Cache layout (one layer): k_cache, v_cache: (num_blocks, block_size, KVH, D).
Slot of a token = block_id * block_size + offset_in_block.
GQA: query head h uses KV head h // G, G = H // KVH.
Softmax is computed in fp32; outputs come back in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t]; a negative slot skips row t.

    k, v: (T, KVH, D); k_cache, v_cache: (num_blocks, block_size, KVH, D); slot_mapping: (T,) int64.
    Writes in place (works for any cache strides).
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(device=k.device, dtype=torch.long)  # (T,)
    keep = slots >= 0  # (T,)
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]  # (T', ...)
    if slots.numel() == 0:
        return
    blocks, offsets = slots // block_size, slots % block_size  # (T',), (T',)
    k_cache[blocks, offsets] = k.to(k_cache.dtype)  # (T', KVH, D) into (NB, BS, KVH, D)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def _gather_context(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """(NB, BS, KVH, D) cache, (B, nb) int64 table -> (B, nb * BS, KVH, D) contiguous context."""
    B, nb = table.shape
    NB, BS, KVH, D = cache.shape
    if cache.is_contiguous():
        # index_select on whole blocks is a plain row copy: ~3x faster on CPU than fancy indexing.
        ctx = cache.view(NB, BS * KVH * D).index_select(0, table.reshape(-1))  # (B*nb, BS*KVH*D)
    else:
        ctx = cache[table]  # (B, nb, BS, KVH, D)
    return ctx.view(B, nb * BS, KVH, D)


def paged_attention_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to its whole cached context.

    q: (B, H, D); k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, max_blocks) int32;
    seq_lens: (B,) int32, each >= 1 (the query sits at position seq_lens[b] - 1).
    Returns (B, H, D) in q's dtype. Vectorized over the batch: the context of every sequence
    is gathered to the longest one's length and positions >= seq_lens[b] are masked.
    """
    B, H, D = q.shape
    block_size, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    if B == 0:
        return q.new_empty(B, H, D)
    # Only gather the blocks the longest sequence needs (padding entries are never read).
    max_len = int(seq_lens.max())
    nb = min(-(-max_len // block_size), block_tables.shape[1])
    L = nb * block_size
    table = block_tables[:, :nb].to(device=k_cache.device, dtype=torch.long)  # (B, nb)
    k = _gather_context(k_cache, table).float()  # (B, L, KVH, D)
    v = _gather_context(v_cache, table).float()  # (B, L, KVH, D)
    qg = q.reshape(B, KVH, G, D).float()  # (B, KVH, G, D)
    # Per KV head, k[:, :, h] is a strided (B, L, D) view that bmm reads in place (no permute copy).
    scores = torch.stack(
        [torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) for h in range(KVH)], dim=1
    )  # (B, KVH, G, L)
    scores.mul_(scale)
    pos = torch.arange(L, device=q.device)  # (L,)
    invalid = pos[None, :] >= seq_lens.to(q.device, torch.long)[:, None]  # (B, L)
    scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
    # Slots past seq_lens hold stale data (maybe NaN from torch.empty): 0 * NaN would leak into
    # the output, so zero them in the gathered copy of V.
    v.masked_fill_(invalid[:, :, None, None], 0.0)
    probs = torch.softmax(scores, dim=-1)  # (B, KVH, G, L) fp32
    out = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(KVH)], dim=1)  # (B, KVH, G, D)
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
