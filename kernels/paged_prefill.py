"""Triton kernel: ragged causal prefill attention over the paged KV cache (chunked prefill).

Sequence b owns query rows [query_start_loc[b], query_start_loc[b+1]) (q_len of them); its
context is seq_lens[b] tokens, the last q_len of which are these queries (already stored in the
cache by store_kv). Query i sits at position seq_lens[b] - q_len + i and attends to positions
<= its own: the cached prefix plus the causal part of the chunk.

Program (m_block, b, h) takes BLOCK_M query rows of one sequence for one query head and walks
context tiles of BLOCK_N tokens up to the last query's position, reading K/V of head h // G
through the block table; flash-attention online softmax in base 2 with fp32 accumulation.
Reference: kernels.reference.paged_prefill_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    SUPPORTED_DTYPES,
    check_cache,
    check_launchable,
    device_guard,
    dot_precision,
    next_pow2,
)
from kernels.reference import paged_prefill_ref  # noqa: F401  (this kernel's reference)

LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # (T, H, D)
    k_cache_ptr,
    v_cache_ptr,  # (NB, BS, KVH, D)
    block_tables_ptr,  # (B, max_blocks) int32
    query_start_loc_ptr,  # (B+1,) int32
    seq_lens_ptr,  # (B,) int32
    out_ptr,  # (T, H, D)
    scale_log2e,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + b)
    prefix = ctx_len - q_len  # tokens cached before this chunk

    offs_m = m0 + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index within the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < D
    q_pos = prefix + offs_m  # (BLOCK_M,) absolute positions
    rows = (q_start + offs_m).to(tl.int64)
    kvh = h // G

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (BLOCK_M, D_PAD)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    # Keys past the last query of this tile are never attended to.
    kv_end = prefix + tl.minimum(m0 + BLOCK_M, q_len)

    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n  # (BLOCK_N,)
        n_mask = pos < kv_end
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, D_PAD)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # (BLOCK_M, BLOCK_N)
        # Causal with the prefix offset; position 0 is always allowed, so no row is all -inf.
        allowed = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, D_PAD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def tile_sizes(dtype: torch.dtype, *, on_gpu: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). GPU: 64x64 (32-wide key tiles for fp32 to bound shared memory).
    Interpreter: 16-row query tiles keep the padding work small."""
    if not on_gpu:
        return 16, 32
    return 64, 32 if dtype == torch.float32 else 64


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of ragged query chunks over their paged context; returns (T, H, D) in q's dtype.

    q: (T, H, D), unit head_dim stride. k_cache, v_cache: (num_blocks, block_size, KVH, D), unit
        head_dim stride, same dtype as q (the chunk's own K/V must already be stored).
    block_tables: (B, max_blocks) int32, unit stride on dim 1.
    query_start_loc: (B+1,) int32 contiguous, non-decreasing, query_start_loc[B] == T.
    seq_lens: (B,) int32 contiguous, seq_lens[b] >= q_len of b (context including the chunk).
    scale: softmax scale. H % KVH == 0; D >= 16.
    max_query_len: largest q_len; None reads it from query_start_loc (one device sync).
    """
    _, BS, KVH, D = check_cache(k_cache, v_cache)
    assert q.dim() == 3, f"q must be (T, H, D), got {tuple(q.shape)}"
    T, H, Dq = q.shape
    assert Dq == D, f"q head_dim {Dq} != cache head_dim {D}"
    assert D >= 16, "head_dim must be >= 16 (tl.dot minimum)"
    assert H % KVH == 0, f"H={H} is not a multiple of KVH={KVH}"
    assert q.dtype == k_cache.dtype and q.dtype in SUPPORTED_DTYPES, f"q {q.dtype} vs cache {k_cache.dtype}"
    assert q.stride(-1) == 1, "q needs a unit stride on head_dim"
    assert block_tables.dim() == 2, "block_tables must be (B, max_blocks)"
    B = block_tables.shape[0]
    assert block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables needs a unit stride on dim 1"
    assert query_start_loc.shape == (B + 1,), f"query_start_loc must be ({B + 1},)"
    assert query_start_loc.dtype == torch.int32, "query_start_loc must be int32"
    assert seq_lens.shape == (B,) and seq_lens.dtype == torch.int32, "seq_lens must be (B,) int32"
    assert query_start_loc.is_contiguous(), "query_start_loc must be contiguous"
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    device = check_launchable(_paged_prefill_kernel, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)

    out = torch.empty((T, H, D), dtype=q.dtype, device=device)
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out
    BLOCK_M, BLOCK_N = tile_sizes(q.dtype, on_gpu=device.type == "cuda")
    grid = (triton.cdiv(max_query_len, BLOCK_M), B, H)
    with device_guard(device):
        _paged_prefill_kernel[grid](
            q,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            seq_lens,
            out,
            scale * LOG2E,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_SIZE=BS,
            G=H // KVH,
            D=D,
            D_PAD=next_pow2(D),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=4,
            num_stages=2,
        )
    return out
