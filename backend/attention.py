"""Paged attention for one layer over a flattened batch: the model's single door to the KV kernels.

The batch holds T tokens of B sequences back to back, no padding. The first `num_decode_seqs`
sequences are decodes (one token each, rows 0..num_decode_seqs-1); the rest are prefill chunks
(any number of tokens, attending causally to their cached prefix and to themselves).

`rotate_and_store` applies the rotary embedding to this step's queries and keys and stores K/V into
the paged cache (`store_kv`); `attend` then runs the decode kernel on the decode rows and the prefill
kernel on the rest (`paged_attention` is store_kv + attend, for callers with rotated q, k, v).
On CUDA these call the Triton kernels (kernels.store_kv, kernels.paged_attention,
kernels.paged_prefill, imported on first use so that CPU-only code never needs `triton`); on CPU the
C++ kernels of kernels.cpu_kernels where they are built (decode and prefill attention, rotary + store
in one op), else the torch references in kernels.reference.

KV cache of one layer: k_cache, v_cache: (num_blocks, block_size, num_kv_heads, head_dim);
the slot of a token is block_id * block_size + offset_in_block.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels import cpu_kernels, reference
from kernels.reference import apply_rope


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each sequence attends to.

    Built once per step by the model runner and passed down explicitly (no globals).
    """

    slot_mapping: torch.Tensor  # (T,) int64: cache slot of each token; < 0 skips the store
    num_decode_seqs: int  # decode sequences come first, one token each
    block_tables: torch.Tensor  # (B, max_blocks) int32: KV block ids of each sequence, 0-padded
    seq_lens: torch.Tensor  # (B,) int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # (B+1,) int32: sequence b owns token rows [qsl[b], qsl[b+1])
    # Given by the model runner on CPU: then the decode context gather is planned once per step.
    block_size: int | None = None
    zero_slot: int | None = None  # a cache slot never written (the runner's null block), if any
    # Derived once per step (not per layer): the prefill sequences' row offsets, rebased to 0.
    prefill_query_start_loc: torch.Tensor = field(init=False, repr=False)  # (B - num_decode_seqs + 1,)
    decode_plan: reference.DecodePlan | None = field(init=False, repr=False)  # CPU reference path only
    slots_all_valid: bool = field(init=False, repr=False)  # checked once per step on CPU (planned steps only)

    def __post_init__(self) -> None:
        B = self.seq_lens.shape[0]
        assert self.slot_mapping.dim() == 1 and self.slot_mapping.dtype == torch.int64, "slot_mapping: (T,) int64"
        assert self.block_tables.dim() == 2 and self.block_tables.shape[0] == B, "block_tables: (B, max_blocks)"
        assert self.block_tables.dtype == torch.int32, "block_tables must be int32"
        assert self.seq_lens.dtype == torch.int32, "seq_lens must be int32"
        assert self.query_start_loc.shape == (B + 1,), "query_start_loc: (B+1,)"
        assert self.query_start_loc.dtype == torch.int32, "query_start_loc must be int32"
        assert 0 <= self.num_decode_seqs <= B, "num_decode_seqs must be in [0, B]"
        nd = self.num_decode_seqs
        object.__setattr__(self, "prefill_query_start_loc", self.query_start_loc[nd:] - nd)
        plan, all_valid = None, False
        if self.block_size is not None and self.block_tables.device.type == "cpu":
            all_valid = bool((self.slot_mapping >= 0).all())
            if nd > 0 and cpu_kernels.paged_decode() is None:  # the C++ kernel reads the block tables itself
                plan = reference.decode_plan(
                    self.block_tables[:nd], self.seq_lens[:nd], self.block_size, self.zero_slot
                )
        object.__setattr__(self, "decode_plan", plan)
        object.__setattr__(self, "slots_all_valid", all_valid)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


StoreKV = Callable[..., None]
Attend = Callable[..., torch.Tensor]


def kernels_for(device: torch.device) -> tuple[StoreKV, Attend, Attend]:
    """(store_kv, decode, prefill) for tensors on `device`: Triton on CUDA; on CPU the torch reference for
    store_kv, and for attention the C++ kernels where built.

    Looked up on every call (a few attribute reads) rather than bound at import, so tests can
    swap any of them with monkeypatch. On CPU, decode goes through cpu_kernels.paged_attention_decode_cpu
    and prefill through cpu_kernels.paged_prefill_cpu: the C++ kernels (kernels/cpu_paged_attention.cpp,
    cpu_paged_prefill.cpp) where they are built and apply, the torch references otherwise.
    """
    if device.type == "cuda":
        store = importlib.import_module("kernels.store_kv").store_kv
        decode = importlib.import_module("kernels.paged_attention").paged_attention_decode
        prefill = importlib.import_module("kernels.paged_prefill").paged_prefill
        return store, decode, prefill
    # The C++ kernels where built (and the dtype fp32), else the references; see cpu_kernels.
    return reference.store_kv_ref, cpu_kernels.paged_attention_decode_cpu, cpu_kernels.paged_prefill_cpu


def rotate_and_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotary embedding of this step's queries and keys, and its keys and values into the paged cache.

    qkv (T, (H + 2*KVH) * D) rows [q heads | k heads | v heads], cos/sin (T, 1, D) -> rotated q (T, H, D).
    On CPU in fp32 one C++ op (kernels/cpu_layer_ops.cpp) where it is built; else torch, then store_kv.
    """
    H, KVH, D, T = num_heads, num_kv_heads, k_cache.shape[-1], qkv.shape[0]
    ops = cpu_kernels.layer_ops_for(qkv, cos, sin, k_cache, v_cache)
    if ops is not None:
        return ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, H, KVH)  # (T, H, D)
    qk = qkv[:, : (H + KVH) * D].view(T, H + KVH, D)  # (T, H + KVH, D) queries then keys
    qk = apply_rope(qk, cos, sin)  # (T, H + KVH, D) rotated together: one pass for q and k
    q, k = qk.split((H, KVH), dim=1)  # (T, H, D), (T, KVH, D)
    v = qkv[:, (H + KVH) * D :].view(T, KVH, D)  # (T, KVH, D)
    store_kv(k, v, k_cache, v_cache, meta)
    return q


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """k, v (T, KVH, D) of this step's tokens into their slots (meta.slot_mapping; negative: skipped)."""
    store = kernels_for(k.device)[0]
    if meta.slots_all_valid:  # the CPU reference skips its per-layer check
        store(k, v, k_cache, v_cache, meta.slot_mapping, all_slots_valid=True)
    else:
        store(k, v, k_cache, v_cache, meta.slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Store k/v of this step's tokens, then attend. q (T, H, D), k/v (T, KVH, D) -> (T, H, D)."""
    store_kv(k, v, k_cache, v_cache, meta)
    return attend(q, k_cache, v_cache, meta, scale)


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q (T, H, D) of this step's tokens, whose K/V are already stored -> attention output (T, H, D):
    the decode kernel on the decode rows, the prefill kernel on the rest."""
    _, decode, prefill = kernels_for(q.device)
    nd, B = meta.num_decode_seqs, meta.num_seqs
    if meta.decode_plan is not None:  # the CPU reference takes the gather planned once per step
        decode = functools.partial(decode, plan=meta.decode_plan)
    if nd == B:  # decode only (the common step): no split, no copy
        return decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)  # (T, H, D)
    if nd == 0:  # prefill only
        return prefill(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale)
    out = torch.empty_like(q)  # (T, H, D)
    out[:nd] = decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale)  # (nd, H, D)
    out[nd:] = prefill(
        q[nd:], k_cache, v_cache, meta.block_tables[nd:], meta.prefill_query_start_loc, meta.seq_lens[nd:], scale
    )  # (T - nd, H, D)
    return out


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed (k_cache, v_cache) pair per layer, each (num_blocks, block_size, KVH, D)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
