"""Paged KV-cache kernels: references vs naive dense attention, Triton kernels vs references.

Without CUDA the Triton kernels run in the Triton interpreter (TRITON_INTERPRET=1 is set here,
before the kernel modules are imported; `triton.jit` reads it when a kernel is defined), on
tiny shapes. With CUDA the same tests run compiled on the GPU.

Every cache starts filled with NaN and only positions < seq_lens are written, so a kernel or
reference that reads a slot it must not (padding block-table entries, the tail of a sequence's
last block) produces NaN and fails.

Tolerances (max abs error vs the reference, which softmaxes in fp32):
  fp32: atol 2e-5, rtol 1e-4 (observed ~1e-6: exact fp32 dots, order of summation differs)
  fp16: atol 4e-3, rtol 1e-2 (probabilities are rounded to fp16 before P @ V, output rounded)
  bf16: atol 3e-2, rtol 2e-2 (GPU only: the interpreter's tl.dot mishandles bf16)
  references vs dense fp64 attention: atol 1e-5 in fp32.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel modules' import

pytest.importorskip("triton")

from kernels.paged_attention import choose_num_splits, paged_attention_decode  # noqa: E402
from kernels.paged_prefill import paged_prefill  # noqa: E402
from kernels.reference import paged_attention_decode_ref, paged_prefill_ref, store_kv_ref  # noqa: E402
from kernels.store_kv import store_kv  # noqa: E402

pytestmark = pytest.mark.kernels

DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ENV_COMPILED = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 1e-2},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}
BF16 = torch.bfloat16
_GPU_ONLY = pytest.mark.skipif(not ON_CUDA, reason="the Triton interpreter computes tl.dot on bf16 wrongly")


def gpu_only(*values):
    """A parametrize row that runs only compiled on CUDA (bf16 rows)."""
    return pytest.param(*values, marks=_GPU_ONLY)


# ----------------------------------------------------------------------------- fixtures


class PagedCase:
    """A NaN-filled paged cache holding random K/V for positions [0, seq_lens[b]) of each sequence.

    k_cache, v_cache: (NB, BS, KVH, D); block_tables: (B, max_blocks) int32, blocks drawn at random
    (shuffled), unused entries 0; dense_k[b], dense_v[b]: (seq_lens[b], KVH, D) the same values unpaged.
    """

    def __init__(self, seq_lens, block_size, kvh, head_dim, dtype, *, extra_blocks=0, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        B = len(seq_lens)
        need = [math.ceil(n / block_size) for n in seq_lens]
        max_blocks = max(need) + extra_blocks
        num_blocks = sum(need) + 3  # a few blocks nobody owns
        perm = torch.randperm(num_blocks, generator=g)
        k_cache = torch.full((num_blocks, block_size, kvh, head_dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        table = torch.zeros(B, max_blocks, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        used = 0
        for b, n in enumerate(seq_lens):
            blocks = perm[used : used + need[b]]
            used += need[b]
            table[b, : need[b]] = blocks.to(torch.int32)
            k = torch.randn(n, kvh, head_dim, generator=g).to(dtype)
            v = torch.randn(n, kvh, head_dim, generator=g).to(dtype)
            pos = torch.arange(n)
            k_cache[blocks[pos // block_size], pos % block_size] = k
            v_cache[blocks[pos // block_size], pos % block_size] = v
            self.dense_k.append(k)
            self.dense_v.append(v)
        self.k_cache, self.v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
        self.block_tables = table.to(DEVICE)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        self.gen = g


def dense_attention(q, k, v, q_pos, scale):
    """Naive unpaged attention in fp64. q: (M, H, D), k/v: (L, KVH, D), q_pos: (M,) -> (M, H, D)."""
    H, KVH = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(H // KVH, dim=1)  # (L, H, D)
    v = v.double().repeat_interleave(H // KVH, dim=1)  # (L, H, D)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k) * scale  # (H, M, L)
    future = torch.arange(k.shape[0])[None, :] > q_pos[:, None]  # (M, L)
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hml,lhd->mhd", scores.softmax(-1), v)  # (M, H, D)


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any(), "kernel output has NaN (read a slot it must not?)"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def make_prefill_inputs(case: PagedCase, q_lens, heads, head_dim, dtype):
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=case.gen).to(dtype).to(DEVICE)
    return q, qsl


# ----------------------------------------------------------------------------- references


def test_importing_kernels_and_references_does_not_import_triton():
    code = "import sys, kernels, kernels.reference; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env=_ENV_COMPILED, cwd=ROOT)


@pytest.mark.skipif(ON_CUDA, reason="the kernel tests below run compiled on this GPU")
def test_kernels_compile_for_sm90_without_a_gpu():
    """Lower every kernel variant to an sm_90 cubin with Triton's bundled ptxas (~40 s cold, cached after):
    catches what the interpreter cannot (tl.dot limits, bf16 lowering, shared memory)."""
    cmd = [sys.executable, "-m", "kernels.compile_check", "--arch", "90"]
    r = subprocess.run(cmd, check=False, env=_ENV_COMPILED, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize(
    "seq_lens,block_size,heads,kvh,head_dim",
    [
        ([1, 17, 40, 100, 33], 16, 4, 4, 64),  # MHA
        ([5, 64, 31], 32, 9, 3, 64),  # GQA 3 (SmolLM2 shape)
        ([70, 2, 129], 16, 16, 2, 128),  # GQA 8
    ],
)
def test_decode_reference_matches_dense(seq_lens, block_size, heads, kvh, head_dim):
    case = PagedCase(seq_lens, block_size, kvh, head_dim, torch.float32, extra_blocks=2)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=case.gen).to(DEVICE)
    scale = head_dim**-0.5
    out = paged_attention_decode_ref(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    for b, n in enumerate(seq_lens):
        ref = dense_attention(q[b : b + 1].cpu(), case.dense_k[b], case.dense_v[b], torch.tensor([n - 1]), scale)
        torch.testing.assert_close(out[b : b + 1].cpu().double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "seq_lens,q_lens,block_size,heads,kvh,head_dim",
    [
        ([5, 40, 70], [5, 1, 37], 16, 6, 2, 64),  # full prompt, decode-like row, chunk after a prefix
        ([33, 64], [0, 64], 32, 8, 1, 128),  # an empty query range, GQA 8
        ([100], [20], 16, 9, 3, 64),
    ],
)
def test_prefill_reference_matches_dense(seq_lens, q_lens, block_size, heads, kvh, head_dim):
    case = PagedCase(seq_lens, block_size, kvh, head_dim, torch.float32)
    q, qsl = make_prefill_inputs(case, q_lens, heads, head_dim, torch.float32)
    scale = head_dim**-0.5
    out = paged_prefill_ref(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, scale)
    for b, (n, ql) in enumerate(zip(seq_lens, q_lens)):
        lo, hi = int(qsl[b]), int(qsl[b + 1])
        ref = dense_attention(q[lo:hi].cpu(), case.dense_k[b], case.dense_v[b], torch.arange(n - ql, n), scale)
        torch.testing.assert_close(out[lo:hi].cpu().double(), ref, atol=1e-5, rtol=1e-5)


def test_store_kv_reference_matches_loop():
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 16, 2, 64, generator=g)
    v_cache = torch.randn(6, 16, 2, 64, generator=g)
    k = torch.randn(7, 2, 64, generator=g)
    v = torch.randn(7, 2, 64, generator=g)
    slots = torch.tensor([0, 17, -1, 95, 40, -7, 3])
    ek, ev = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // 16, s % 16] = k[t]
            ev[s // 16, s % 16] = v[t]
    # Contiguous caches take the flat index_copy_ path, strided ones fancy indexing: same result.
    strided_k, strided_v = (torch.empty(6, 16, 4, 64).transpose(1, 2)[:, :2].transpose(1, 2) for _ in "kv")
    assert not strided_k.is_contiguous() and not strided_v.is_contiguous()  # (6, 16, 2, 64) views
    strided_k.copy_(k_cache)
    strided_v.copy_(v_cache)
    store_kv_ref(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ek) and torch.equal(v_cache, ev)
    store_kv_ref(k, v, strided_k, strided_v, slots)
    assert torch.equal(strided_k, ek) and torch.equal(strided_v, ev)
    # A caller that checked the slots once per step skips the per-layer check.
    valid = slots >= 0
    k_cache2, v_cache2 = k_cache.clone(), v_cache.clone()
    store_kv_ref(k[valid] * 2, v[valid] * 2, k_cache2, v_cache2, slots[valid], all_slots_valid=True)
    assert torch.equal(k_cache2[0, 0], 2 * k[0]) and torch.equal(v_cache2[95 // 16, 95 % 16], 2 * v[3])


# ----------------------------------------------------------------------------- store_kv kernel


@pytest.mark.parametrize(
    "block_size,kvh,head_dim,dtype",
    [(16, 2, 64, torch.float32), (32, 3, 128, torch.float16), (16, 8, 64, torch.bfloat16)],
)
def test_store_kv_kernel_matches_reference(block_size, kvh, head_dim, dtype):
    g = torch.Generator().manual_seed(2)
    num_blocks, T = 5, 12
    k_cache = torch.randn(num_blocks, block_size, kvh, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn_like(k_cache)
    # k and v as strided slices of one fused (T, 2*KVH, D) projection, as the model produces them.
    kv = torch.randn(T, 2 * kvh, head_dim, generator=g).to(dtype).to(DEVICE)
    k, v = kv[:, :kvh], kv[:, kvh:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[[2, 7]] = -1
    slots = slots.to(DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, ref_k, ref_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


# ----------------------------------------------------------------------------- decode kernel


@pytest.mark.parametrize(
    "seq_lens,block_size,heads,kvh,head_dim,dtype",
    [
        ([1, 17, 100], 16, 4, 4, 64, torch.float32),  # GQA 1
        ([64, 33, 5, 130], 32, 6, 2, 128, torch.float32),  # GQA 3
        ([40, 97], 16, 16, 2, 64, torch.float32),  # GQA 8
        ([9, 70], 32, 9, 3, 64, torch.float16),  # SmolLM2 heads
        ([65, 3], 16, 8, 1, 128, torch.float16),  # GQA 8, one KV head
        gpu_only([200, 31], 16, 32, 8, 128, BF16),  # Llama-8B heads
    ],
)
def test_decode_kernel_matches_reference(seq_lens, block_size, heads, kvh, head_dim, dtype):
    case = PagedCase(seq_lens, block_size, kvh, head_dim, dtype, extra_blocks=1)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=case.gen).to(dtype).to(DEVICE)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = paged_attention_decode(*args, num_splits=1)
    assert_close(out, paged_attention_decode_ref(*args), dtype)


@pytest.mark.parametrize(
    "seq_lens,block_size,heads,kvh,head_dim,dtype,num_splits",
    [
        ([300, 1, 129], 16, 6, 2, 64, torch.float32, 4),  # short sequences leave splits empty
        ([257, 190], 32, 8, 1, 128, torch.float32, 3),
        ([500, 64], 16, 9, 3, 64, torch.float16, 5),
        gpu_only([1000, 20], 32, 16, 2, 128, BF16, 8),
    ],
)
def test_decode_split_k_matches_reference(seq_lens, block_size, heads, kvh, head_dim, dtype, num_splits):
    case = PagedCase(seq_lens, block_size, kvh, head_dim, dtype, extra_blocks=2)
    q = torch.randn(len(seq_lens), heads, head_dim, generator=case.gen).to(dtype).to(DEVICE)
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, head_dim**-0.5)
    out = paged_attention_decode(*args, num_splits=num_splits)
    assert_close(out, paged_attention_decode_ref(*args), dtype)


def test_decode_strided_q():
    """q as a head slice of a fused qkv tensor (token stride != H * D)."""
    case = PagedCase([50, 7], 16, 2, 64, torch.float32)
    qkv = torch.randn(2, 8 + 2 * 2, 64, generator=case.gen).to(DEVICE)
    q = qkv[:, :8]
    args = (q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125)
    assert_close(paged_attention_decode(*args), paged_attention_decode_ref(*args), torch.float32)


def test_split_k_rule():
    sms = 132  # H200
    assert choose_num_splits(256, 8, 32768, sms) == 1  # grid already fills the GPU
    assert choose_num_splits(1, 8, 512, sms) == 1  # context too short to split
    assert choose_num_splits(1, 8, 32768, sms) == 32  # capped at MAX_SPLITS
    assert choose_num_splits(4, 8, 4096, sms) == 8  # ceil(264 / 32) = 9, capped by 4096 // 512
    assert choose_num_splits(16, 8, 2048, sms) == 3  # ceil(264 / 128)
    assert choose_num_splits(2, 2, 4096, 1) == 1  # CPU / interpreter: never splits by default


# ----------------------------------------------------------------------------- prefill kernel


@pytest.mark.parametrize(
    "seq_lens,q_lens,block_size,heads,kvh,head_dim,dtype",
    [
        ([5, 40, 70], [5, 1, 37], 16, 4, 4, 64, torch.float32),  # GQA 1; 37 rows span 3 query tiles
        ([33, 64], [0, 64], 32, 6, 2, 128, torch.float32),  # GQA 3, an empty query range
        ([90, 18], [20, 18], 16, 8, 1, 64, torch.float32),  # GQA 8, chunk after a cached prefix
        ([50, 23], [50, 4], 32, 9, 3, 64, torch.float16),
        ([70], [35], 16, 8, 1, 128, torch.float16),
        gpu_only([130, 40], [70, 40], 16, 32, 8, 128, BF16),
    ],
)
def test_prefill_kernel_matches_reference(seq_lens, q_lens, block_size, heads, kvh, head_dim, dtype):
    case = PagedCase(seq_lens, block_size, kvh, head_dim, dtype, extra_blocks=1)
    q, qsl = make_prefill_inputs(case, q_lens, heads, head_dim, dtype)
    args = (q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, head_dim**-0.5)
    assert_close(paged_prefill(*args), paged_prefill_ref(*args), dtype)


# ----------------------------------------------------------------------------- wrapper checks


def test_wrappers_reject_bad_inputs():
    case = PagedCase([20], 16, 2, 64, torch.float32)
    q = torch.randn(1, 4, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="int32"):
        paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables.long(), case.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="multiple"):
        paged_attention_decode(q[:, :3], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1)
    with pytest.raises(AssertionError, match="dtype|vs cache"):
        paged_attention_decode(q.half(), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="head_dim"):
        paged_prefill(q[..., :32], case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, 0.1)
    kv = torch.randn(1, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="int64"):
        store_kv(kv, kv, case.k_cache, case.v_cache, torch.zeros(1, dtype=torch.int32, device=DEVICE))


def test_decode_reference_with_a_zero_slot_plan_matches_masking():
    """The engine's CPU path: padded positions read a never-written null block instead of being masked."""
    from kernels.reference import decode_plan

    gen = torch.Generator().manual_seed(3)
    nb, bs, kvh, d, heads = 10, 16, 3, 64, 9
    k_cache = torch.full((nb + 1, bs, kvh, d), float("nan"))
    v_cache = torch.full((nb + 1, bs, kvh, d), float("nan"))
    k_cache[nb] = 0.0
    v_cache[nb] = 0.0
    seq_lens = torch.tensor([37, 5, 20], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 1], [0, 0, 0], [9, 2, 0]], dtype=torch.int32)
    for b, n in enumerate(seq_lens.tolist()):
        for p in range(n):
            k_cache[tables[b, p // bs], p % bs] = torch.randn(kvh, d, generator=gen)
            v_cache[tables[b, p // bs], p % bs] = torch.randn(kvh, d, generator=gen)
    q = torch.randn(3, heads, d, generator=gen)
    masked = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, d**-0.5)
    plan = decode_plan(tables, seq_lens, bs, zero_slot=nb * bs)
    planned = paged_attention_decode_ref(q, k_cache, v_cache, tables, seq_lens, d**-0.5, plan=plan)
    assert not torch.isnan(masked).any()
    torch.testing.assert_close(planned, masked, atol=1e-6, rtol=1e-5)
