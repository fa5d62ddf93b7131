"""Triton kernel: paged-attention decode (one query token per sequence), with optional split-K.

Program (b, kv_head, split) loads the G = H // KVH query heads that share kv_head as one
(G_PAD, D) tile, so each K/V tile is read once for the whole group, and walks the token range
[split * tokens_per_split, min((split + 1) * tokens_per_split, seq_lens[b])) in BLOCK_N-token
tiles. Token pos lives in cache block block_tables[b, pos // block_size] at offset
pos % block_size. Online softmax in base 2 with fp32 running max / sum / accumulator.

Split-K (flash-decoding): with one split the kernel writes the normalised output directly.
With S > 1 splits each program writes its normalised partial output and its log2-sum-exp to fp32
scratch, and `_decode_reduce_kernel` merges the S partials per (b, head). Rule (`choose_num_splits`):
split only when B * KVH < the GPU's SM count (too few programs to fill it) and the context
(block_tables.shape[1] * block_size, known without a device sync) holds at least 2 * MIN_SPLIT_TOKENS;
then S = min(ceil(2 * SMs / (B * KVH)), context // MIN_SPLIT_TOKENS, MAX_SPLITS).
Reference: kernels.reference.paged_attention_decode_ref.
"""

from __future__ import annotations

import math

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
    num_sms,
)
from kernels.reference import paged_attention_decode_ref  # noqa: F401  (this kernel's reference)

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 512  # a split below this many tokens costs more in the reduce than it saves
MAX_SPLITS = 32
BLOCK_N = 64  # context tokens per inner-loop tile


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # (B, H, D)
    k_cache_ptr,
    v_cache_ptr,  # (NB, BS, KVH, D)
    block_tables_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,) int32
    out_ptr,  # (B, H, D), written when NUM_SPLITS == 1
    part_out_ptr,  # (B, H, NUM_SPLITS, D) fp32, written when NUM_SPLITS > 1
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32 log2-sum-exp of each split
    scale_log2e,  # softmax scale * log2(e)
    tokens_per_split,  # multiple of BLOCK_N
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < G
    d_mask = offs_d < D
    heads = kvh * G + offs_g  # (G_PAD,) query heads served by this KV head
    b64 = b.to(tl.int64)

    q = tl.load(
        q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # (G_PAD, D_PAD)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = block_tables_ptr + b64 * stride_bt
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # (BLOCK_N,) token positions
        n_mask = pos < end
        block_ids = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(
            k_head + block_ids[:, None] * stride_kb + in_block[:, None] * stride_ks + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, D_PAD)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e  # (G_PAD, BLOCK_N)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])  # (G_PAD, BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_head + block_ids[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        )  # (BLOCK_N, D_PAD)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # An empty split (start >= seq_len) has l_i == 0: it stores lse = -inf and zeros.
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (b64 * H + heads) * NUM_SPLITS + split  # (G_PAD,) index into (B, H, NUM_SPLITS)
        tl.store(part_out_ptr + row[:, None] * D + offs_d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,  # (B, H, NUM_SPLITS, D) fp32
    part_lse_ptr,  # (B, H, NUM_SPLITS) fp32
    out_ptr,  # (B, H, D)
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < D
    row = (b.to(tl.int64) * H + h) * NUM_SPLITS + offs_s  # (S_PAD,)
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: split 0 always holds token 0
    w = tl.exp2(lse - m)  # (S_PAD,) weight of each split, 0 for empty ones
    o = tl.load(part_out_ptr + row[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)  # (D_PAD,)
    dst = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Split-K rule (see module docstring): 1 unless the grid is smaller than the GPU and the context long."""
    work = batch * num_kv_heads
    if work >= sm_count or max_context < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(math.ceil(2 * sm_count / work), max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention through the block table; returns (B, H, D) in q's dtype.

    q: (B, H, D), unit head_dim stride (token/head strides free, e.g. a slice of a fused qkv).
    k_cache, v_cache: (num_blocks, block_size, KVH, D), unit head_dim stride; same dtype as q.
    block_tables: (B, max_blocks) int32, unit stride on dim 1; entries past a sequence's blocks are
        never read. seq_lens: (B,) int32 contiguous, each in [1, max_blocks * block_size].
    scale: softmax scale (usually D ** -0.5). H % KVH == 0; D >= 16.
    num_splits: force the split-K factor (tests, benchmarks); None applies `choose_num_splits`.
    """
    _, BS, KVH, D = check_cache(k_cache, v_cache)
    assert q.dim() == 3, f"q must be (B, H, D), got {tuple(q.shape)}"
    B, H, Dq = q.shape
    assert Dq == D, f"q head_dim {Dq} != cache head_dim {D}"
    assert D >= 16, "head_dim must be >= 16 (tl.dot minimum)"
    assert H % KVH == 0, f"H={H} is not a multiple of KVH={KVH}"
    assert q.dtype == k_cache.dtype and q.dtype in SUPPORTED_DTYPES, f"q {q.dtype} vs cache {k_cache.dtype}"
    assert q.stride(-1) == 1, "q needs a unit stride on head_dim"
    assert block_tables.dim() == 2 and block_tables.shape[0] == B, f"block_tables must be ({B}, max_blocks)"
    assert block_tables.dtype == torch.int32, f"block_tables must be int32, got {block_tables.dtype}"
    assert block_tables.stride(1) == 1, "block_tables needs a unit stride on dim 1"
    assert seq_lens.shape == (B,) and seq_lens.dtype == torch.int32, "seq_lens must be (B,) int32"
    assert seq_lens.is_contiguous(), "seq_lens must be contiguous"
    device = check_launchable(_paged_decode_kernel, q, k_cache, v_cache, block_tables, seq_lens)

    out = torch.empty((B, H, D), dtype=q.dtype, device=device)
    max_context = block_tables.shape[1] * BS
    if B == 0 or max_context == 0:
        return out
    if num_splits is None:
        sms = (
            num_sms(device.index if device.index is not None else torch.cuda.current_device())
            if device.type == "cuda"
            else 1
        )
        num_splits = choose_num_splits(B, KVH, max_context, sms)
    assert num_splits >= 1
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_context, tokens_per_split)

    G = H // KVH
    G_PAD = max(16, next_pow2(G))  # tl.dot needs M >= 16
    D_PAD = next_pow2(D)
    if num_splits > 1:
        part_out = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=device)
        part_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused
    with device_guard(device):
        _paged_decode_kernel[(B, KVH, num_splits)](
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            scale * LOG2E,
            tokens_per_split,
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
            H=H,
            BLOCK_SIZE=BS,
            G=G,
            G_PAD=G_PAD,
            D=D,
            D_PAD=D_PAD,
            BLOCK_N=BLOCK_N,
            NUM_SPLITS=num_splits,
            DOT_PRECISION=dot_precision(q.dtype),
            num_warps=4,
            num_stages=2,
        )
        if num_splits > 1:
            _decode_reduce_kernel[(B, H)](
                part_out,
                part_lse,
                out,
                out.stride(0),
                out.stride(1),
                H=H,
                NUM_SPLITS=num_splits,
                S_PAD=next_pow2(num_splits),
                D=D,
                D_PAD=D_PAD,
                num_warps=1 if D_PAD <= 128 else 2,
            )
    return out
