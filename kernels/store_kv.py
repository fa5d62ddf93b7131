"""Triton kernel: scatter new K/V rows into paged cache slots.

One program per token: it copies that token's (KVH, D) key and value rows into slot
slot_mapping[t] = block_id * block_size + offset. A negative slot (padding) writes nothing.
Reference: kernels.reference.store_kv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_cache, check_launchable, device_guard, next_pow2
from kernels.reference import store_kv_ref  # noqa: F401  (the reference this kernel is tested against)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,  # (T, KVH, D) new keys / values
    k_cache_ptr,
    v_cache_ptr,  # (NB, BS, KVH, D)
    slot_ptr,  # (T,) int64
    stride_kt,
    stride_kh,  # k strides (token, head); head_dim stride is 1
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,  # k_cache strides (block, slot, head)
    stride_vcb,
    stride_vcs,
    stride_vch,  # v_cache strides
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    KVH_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE  # int64
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, KVH_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < KVH) & (offs_d[None, :] < D)  # (KVH_PAD, D_PAD)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write k[t], v[t] into cache slot slot_mapping[t] in place; negative slots are skipped.

    k, v: (T, KVH, D), any token/head strides, unit head_dim stride, same dtype as the cache.
    k_cache, v_cache: (num_blocks, block_size, KVH, D), unit head_dim stride.
    slot_mapping: (T,) int64, contiguous; slots must be < num_blocks * block_size (not checked on device).
    """
    _, BS, KVH, D = check_cache(k_cache, v_cache)
    assert k.dim() == 3 and k.shape == v.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (T, KVH, D)"
    T = k.shape[0]
    assert k.shape[1:] == (KVH, D), f"k rows {tuple(k.shape[1:])} do not match cache (KVH, D) = {(KVH, D)}"
    assert k.dtype == v.dtype == k_cache.dtype, f"dtype mismatch: k {k.dtype}, v {v.dtype}, cache {k_cache.dtype}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need a unit stride on head_dim"
    assert slot_mapping.shape == (T,), f"slot_mapping must be ({T},), got {tuple(slot_mapping.shape)}"
    assert slot_mapping.dtype == torch.int64, f"slot_mapping must be int64, got {slot_mapping.dtype}"
    assert slot_mapping.is_contiguous(), "slot_mapping must be contiguous"
    device = check_launchable(_store_kv_kernel, k, v, k_cache, v_cache, slot_mapping)
    if T == 0:
        return
    with device_guard(device):
        _store_kv_kernel[(T,)](
            k,
            v,
            k_cache,
            v_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            BLOCK_SIZE=BS,
            KVH=KVH,
            KVH_PAD=next_pow2(KVH),
            D=D,
            D_PAD=next_pow2(D),
            num_warps=4 if KVH * D >= 1024 else 1,
        )
