"""The C++ CPU kernels (kernels/cpu_kernels.py) and the CPU fast paths of backend.layers.

Every path must give what torch gives: the linear kernel against `linear_ref`, the decode attention
kernel against kernels.reference.paged_attention_decode_ref, the layer ops (norm, rotary + cache
store, silu * up) against their references, Linear's three CPU paths (kernel, split-bmm fallback,
oneDNN) against F.linear, the CPU RMSNorm's two paths against F.rms_norm.
fp32 sums in a different order: tolerances are a few ulps of the result's magnitude.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backend.layers import Linear, RMSNorm
from kernels import cpu_kernels, reference

kernel = cpu_kernels.linear()
decode_kernel = cpu_kernels.paged_decode()
layer_ops = cpu_kernels.layer_ops()
needs_kernel = pytest.mark.skipif(
    kernel is None, reason="the llm_cpu kernels could not be built here (see the log line)"
)


def linear(x, w, bias=None, residual=None):
    """The kernel on w (N, K), packed as Linear packs it."""
    return kernel(x, cpu_kernels.pack_linear_weight(w), w.shape[0], bias, residual)


@pytest.fixture(params=["avx2", "avx512"])
def isa(request):
    """The kernels' code for each instruction set this CPU has (AVX-512: the linear tiles and the decode and
    prefill attention paths, only where it has it)."""
    if kernel is None:
        pytest.skip("kernel not built")
    on = torch.ops.llm_cpu.use_avx512(request.param == "avx512")
    if request.param == "avx512" and not on:
        pytest.skip("no AVX-512 on this CPU")
    yield request.param
    torch.ops.llm_cpu.use_avx512(True)  # the default: on where the CPU has it


# (N, K): N a multiple of the 32-column panel or not (a zero-padded last panel), fewer panels than a
# thread's grain (one thread) or more, than the panels one row reads at once (2-4) or not a multiple of them.
SHAPES = [(1, 8), (7, 13), (64, 576), (130, 1536), (1000, 70), (3, 1), (320, 33)]
# M: one row (several panels at once), tiles of 2-12 rows (AVX-512) or 2-3 (AVX2), passes of equal size.
ROWS = [1, 2, 3, 4, 5, 8, 9, 12, 13, 14, 25, 32]


def test_kernels_are_built_on_avx2_machines():
    # A machine that can run them and has a compiler must not silently fall back to the slower paths.
    if os.environ.get("LLM_CPU_KERNELS") == "0":
        pytest.skip("switched off with LLM_CPU_KERNELS=0")
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel is not None and decode_kernel is not None


@needs_kernel
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, False), (False, True), (True, True)])
def test_kernel_matches_reference(M, N, K, with_bias, with_residual, isa):
    g = torch.Generator().manual_seed(M * 10**6 + N * 1000 + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    residual = torch.randn(M, N, generator=g) if with_residual else None
    got = linear(x, w, bias, residual)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, cpu_kernels.linear_ref(x, w, bias, residual), rtol=1e-5, atol=1e-5 * K**0.5)


@pytest.mark.parametrize("M", [1, 4, 12])
def test_kernel_gives_the_same_result_on_any_thread_count(M, isa):
    x, w = torch.randn(M, 576), torch.randn(3070, 576)  # 3070: panels left over from the streams, a padded one
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w)
        torch.set_num_threads(2)
        two = linear(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # weight panels are split between threads, never a sum


@pytest.mark.parametrize("M", [2, 7, 13, 32])
def test_kernel_row_results_do_not_depend_on_the_batch(M, isa):
    # Each output is one chain of FMAs over k in every tile, so a decode row gets the same logits alone
    # as beside other sequences (seeded sampling does not drift with the batch).
    x, w, b = torch.randn(M, 200), torch.randn(1001, 200), torch.randn(1001)
    together = linear(x, w, b)
    for i in range(M):
        assert torch.equal(linear(x[i : i + 1], w, b), together[i : i + 1])


@needs_kernel
@pytest.mark.parametrize("M", [1, 5, 13])
def test_kernel_gives_the_same_bits_on_avx2_and_avx512(M):
    if not torch.ops.llm_cpu.use_avx512(True):
        pytest.skip("no AVX-512 on this CPU")
    x, w, b, r = torch.randn(M, 300), torch.randn(650, 300), torch.randn(650), torch.randn(M, 650)
    try:
        wide = linear(x, w, b, r)
        torch.ops.llm_cpu.use_avx512(False)
        narrow = linear(x, w, b, r)
    finally:
        torch.ops.llm_cpu.use_avx512(True)
    assert torch.equal(wide, narrow)


@needs_kernel
def test_packed_weight_layout():
    w = torch.arange(40 * 5, dtype=torch.float32).view(40, 5)  # 40 columns: a full panel and 8 padded ones
    p = cpu_kernels.pack_linear_weight(w)
    assert p.shape == (2, 5, 32)
    k_order = [0, 2, 4, 1, 3]  # even k first, then odd k (two read streams per panel)
    assert torch.equal(p[0], w[:32, k_order].T) and torch.equal(p[1, :, :8], w[32:, k_order].T)
    assert not p[1, :, 8:].any()


def q4_weight(N, K, seed=0):
    """An (N, K) weight exactly d * q + m in every run of 32 k (fp16 d and m, q in 0..15), as a Q4_1 GGUF
    dequantizes (gguf.quants: (d * q) + m in float32), each block holding its q = 0 and q = 15."""
    g = torch.Generator().manual_seed(seed)
    nb = K // 32
    d = (torch.rand(N, nb, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(N, nb, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (N, nb, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d[0, 0] = 0  # a block of one value
    return (d * q + m).reshape(N, K)


@needs_kernel
@pytest.mark.parametrize("N,K", [(64, 576), (130, 1536), (40, 32), (3, 96)])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8, 13, 25])
def test_q4_panels_give_the_fp32_panels_bits(M, N, K, isa):
    # Dequantized in registers by one fma(d, q, m), then the same FMA chain over k: not close, identical.
    w = q4_weight(N, K, seed=N + K)
    q4 = cpu_kernels.pack_q4_weight(w)
    assert q4 is not None and q4.dtype == torch.uint8 and q4.shape == (-(-N // 32), K // 32, 768)
    assert_same_bits(M, w, q4)


def assert_same_bits(M: int, w: torch.Tensor, quant_panels: torch.Tensor) -> None:
    """The kernel on `quant_panels` gives the fp32 panels' results for M random rows, bit for bit, with
    and without bias and residual."""
    N, K = w.shape
    g = torch.Generator().manual_seed(M + N + K)
    x, b, r = torch.randn(M, K, generator=g), torch.randn(N, generator=g), torch.randn(M, N, generator=g)
    for bias, residual in [(None, None), (b, r)]:
        assert torch.equal(kernel(x, quant_panels, N, bias, residual), linear(x, w, bias, residual))


def q8_weight(N, K, seed=0):
    """An (N, K) weight exactly d * q in every run of 32 k (fp16 d, q in -127..127), as a Q8_0 GGUF
    dequantizes, each block holding a q of magnitude 127."""
    g = torch.Generator().manual_seed(seed)
    nb = K // 32
    d = (1e-4 + torch.rand(N, nb, 1, generator=g) * 0.001).half().float()
    q = torch.randint(-127, 128, (N, nb, 32), generator=g).float()
    q[..., 3] = -127
    d[0, 0], q[0, 0] = 0, 0  # an all-zero block (a quantizer gives q = 0 there: no -0.0)
    return (d * q).reshape(N, K)


@needs_kernel
@pytest.mark.parametrize("N,K", [(64, 576), (130, 1536), (40, 32)])
@pytest.mark.parametrize("M", [1, 2, 3, 8, 13])
def test_q8_panels_give_the_fp32_panels_bits(M, N, K, isa):
    w = q8_weight(N, K, seed=N + K)
    q8 = cpu_kernels.pack_q8_weight(w)
    assert q8 is not None and q8.dtype == torch.uint8 and q8.shape == (-(-N // 32), K // 32, 1152)
    assert cpu_kernels.pack_q4_weight(w) is None  # one format each
    assert_same_bits(M, w, q8)


@needs_kernel
def test_q4_packing_refuses_what_it_cannot_rebuild_exactly():
    w = q4_weight(64, 576)
    assert cpu_kernels.pack_q4_weight(torch.randn(64, 576)) is None  # any fp32 weight
    assert cpu_kernels.pack_q4_weight(w[:, :570].contiguous()) is None  # K not a multiple of 32
    almost = w.clone()
    almost[5, 100] = torch.nextafter(almost[5, 100], torch.tensor(1.0))  # one value one ulp off
    assert cpu_kernels.pack_q4_weight(almost) is None
    assert cpu_kernels.pack_q4_weight(w.double()) is None
    assert cpu_kernels.pack_q8_weight(torch.randn(64, 576)) is None and cpu_kernels.pack_q8_weight(w) is None


@needs_kernel
def test_linear_reads_q4_panels_for_few_rows_with_the_same_results(monkeypatch):
    w, b = q4_weight(96, 64), torch.randn(96)
    lin = Linear(64, 96, bias=True)
    lin.load(w, b)
    assert lin.quant_panels is not None and lin.quant_panels.shape[-1] == 768  # Q4
    assert lin.panels_for(cpu_kernels.Q4_MAX_ROWS) is lin.quant_panels
    assert lin.panels_for(cpu_kernels.Q4_MAX_ROWS + 1) is lin.panels
    for M in (1, cpu_kernels.Q4_MAX_ROWS, cpu_kernels.Q4_MAX_ROWS + 1):
        x = torch.randn(M, 64)
        assert torch.equal(lin(x), linear(x, w, b))
    monkeypatch.setenv("LLM_Q4_PANELS", "0")  # the switch: fp32 panels only
    lin.repack()
    assert lin.quant_panels is None and lin.panels_for(1) is lin.panels


@needs_kernel
@pytest.mark.model
def test_smollm2s_matrices_are_all_read_quantized():
    # The served GGUF holds the layers' as Q4_1 and the (tied) embedding as Q8_0: every one must be found
    # exact, or decode steps read 4-5x the bytes.
    from backend.checkpoint import load_checkpoint

    state_dict = load_checkpoint("smollm2").state_dict
    projections = [name for name in state_dict if name.endswith("_proj.weight")]
    assert len(projections) == 7 * 30
    assert all(cpu_kernels.pack_q4_weight(state_dict[name]) is not None for name in projections)
    assert cpu_kernels.pack_q8_weight(state_dict["model.embed_tokens.weight"]) is not None  # Q8_0: the lm_head


@needs_kernel
@pytest.mark.parametrize(
    "case, message",
    [
        (lambda: linear(torch.randn(1, 8, dtype=torch.float64), torch.randn(4, 8)), "float32"),
        (lambda: linear(torch.randn(2, 8, 1), torch.randn(4, 8)), r"\(M, K\)"),
        (lambda: kernel(torch.randn(1, 8), torch.randn(4, 8), 4), "packed"),
        (lambda: kernel(torch.randn(1, 8), torch.randn(8, 2, 32).transpose(0, 1), 40), "contiguous"),
        (lambda: kernel(torch.randn(1, 8), cpu_kernels.pack_linear_weight(torch.randn(4, 8)), 33), "n = 33"),
        (lambda: linear(torch.randn(1, 6), torch.randn(4, 8)), "6 columns"),
        (lambda: linear(torch.randn(1, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
        (lambda: linear(torch.randn(2, 8), torch.randn(4, 8), None, torch.randn(1, 4)), "residual"),
        (lambda: kernel(torch.randn(1, 64), torch.zeros(1, 2, 700, dtype=torch.uint8), 32), "Q4/Q8 panels"),
        (lambda: kernel(torch.randn(1, 60), cpu_kernels.pack_q4_weight(q4_weight(32, 64)), 32), "60 columns"),
    ],
)
def test_kernel_rejects_bad_input_with_a_clear_error(case, message):
    with pytest.raises(RuntimeError, match=message):
        case()


def test_loader_honours_the_off_switch(monkeypatch):
    monkeypatch.setenv("LLM_CPU_KERNELS", "0")
    assert cpu_kernels._build() is False  # load() keeps _build()'s answer: the switch is read once per process


def test_only_load_builds_or_loads_the_library():
    # Importing the engine and building a model leave the library alone; load() is the one place.
    code = (
        "import torch; from kernels import cpu_kernels as k; from backend.engine import LLMEngine; "
        "from backend.models import build_model; from tests.engine_helpers import tiny_checkpoint\n"
        "ck = tiny_checkpoint(); m = build_model(ck.config); m.load_weights(ck.state_dict)\n"
        "assert k._kernels is None and k.linear() is None and k.layer_ops_for(torch.ones(2)) is None\n"
        "assert m.layers[0].self_attn.qkv_proj.panels is None\n"
        "print(k.load(), k.linear() is not None)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == (["True", "True"] if kernel is not None else ["False", "False"])


needs_decode_kernel = pytest.mark.skipif(decode_kernel is None, reason="the llm_cpu kernels could not be built here")


def _paged_case(B, H, KVH, D, BS, seed, max_blocks=6, num_blocks=40, strided=False):
    """Random caches (NaN in every slot no sequence owns, which must never be read), random block
    tables of distinct blocks, ragged context lengths including 1 and a full table."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BS, KVH, D)
    if strided:  # blocks apart in memory, unit head_dim stride: a view of a wider tensor
        k_cache = torch.full((num_blocks, BS, KVH, D + 5), float("nan"))[..., :D]
        v_cache = torch.full((num_blocks, BS, KVH, D + 5), float("nan"))[..., :D]
    else:
        k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    lens = torch.randint(1, max_blocks * BS + 1, (B,), generator=g, dtype=torch.int32)
    lens[0], lens[-1] = 1, max_blocks * BS
    tables = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).int()
    for b in range(B):
        for p in range(int(lens[b])):
            block, off = int(tables[b, p // BS]), p % BS
            k_cache[block, off] = torch.randn(KVH, D, generator=g)
            v_cache[block, off] = torch.randn(KVH, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    return q, k_cache, v_cache, tables, lens


@needs_decode_kernel
@pytest.mark.parametrize("H, KVH", [(4, 4), (9, 3), (8, 2), (16, 2)])  # GQA ratios 1, 3, 4, 8
# 24: 8-position dots, not the 64-wide V loop; 20: scalar tails;
# AVX-512 takes D = 32 (G <= 8), 64 (G <= 4), 128 (G <= 2)
@pytest.mark.parametrize("D", [64, 128, 32, 24, 20])
@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("strided", [False, True])
def test_decode_kernel_matches_reference(H, KVH, D, BS, strided, isa):
    q, k_cache, v_cache, tables, lens = _paged_case(B=5, H=H, KVH=KVH, D=D, BS=BS, seed=H * D + BS, strided=strided)
    scale = D**-0.5
    got = decode_kernel(q, k_cache, v_cache, tables, lens, scale)
    want = reference.paged_attention_decode_ref(q, k_cache, v_cache, tables, lens, scale)
    assert got.shape == (5, H, D) and torch.isfinite(got).all()  # no NaN slot was read
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_decode_kernel
def test_decode_entry_point_falls_back_to_the_reference_off_fp32():
    q, k_cache, v_cache, tables, lens = _paged_case(B=3, H=4, KVH=2, D=16, BS=16, seed=1)
    q16, k16, v16 = q.half(), k_cache.half(), v_cache.half()
    got = cpu_kernels.paged_attention_decode_cpu(q16, k16, v16, tables, lens, 0.25)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, reference.paged_attention_decode_ref(q16, k16, v16, tables, lens, 0.25))
    empty = cpu_kernels.paged_attention_decode_cpu(q[:0], k_cache, v_cache, tables[:0], lens[:0], 0.25)
    assert empty.shape == (0, 4, 16)


@needs_decode_kernel
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(seq_lens=torch.tensor([0, 5, 5], dtype=torch.int32)), "outside"),
        (lambda a: a.update(seq_lens=torch.tensor([97, 5, 5], dtype=torch.int32)), "outside"),
        (lambda a: a["block_tables"].__setitem__((1, 0), 40), "not a cache block"),
        (lambda a: a.update(block_tables=a["block_tables"].long()), "int32"),
        (lambda a: a.update(q=a["q"].double()), "float32"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple"),
    ],
)
def test_decode_kernel_rejects_bad_input_with_a_clear_error(change, message):
    q, k_cache, v_cache, tables, lens = _paged_case(B=3, H=4, KVH=2, D=16, BS=16, seed=2)
    args = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "seq_lens": lens}
    change(args)
    with pytest.raises(RuntimeError, match=message):
        decode_kernel(args["q"], args["k_cache"], args["v_cache"], args["block_tables"], args["seq_lens"], 0.25)


prefill_kernel = cpu_kernels.paged_prefill()
needs_prefill_kernel = pytest.mark.skipif(prefill_kernel is None, reason="the llm_cpu kernels could not be built here")


def _prefill_case(H, KVH, D, BS, seed, strided=False):
    """_paged_case's caches and tables, and new query rows per sequence: all of a short context, a chunk
    after a cached prefix, one token after a long prefix, a whole table, and a sequence with no new rows
    (as in a step that only decodes it elsewhere)."""
    q_lens = [1, 7, 1, 96, 0, 40]
    _, k_cache, v_cache, tables, lens = _paged_case(B=len(q_lens), H=H, KVH=KVH, D=D, BS=BS, seed=seed, strided=strided)
    lens = lens.clone()
    lens[:] = torch.tensor([1, 19, 95, 96, 50, 40], dtype=torch.int32).clamp(max=int(tables.shape[1]) * BS)
    g = torch.Generator().manual_seed(seed + 1)
    for b in range(len(q_lens)):  # fill every slot the new lengths own (the decode case filled fewer)
        for p in range(int(lens[b])):
            block, off = int(tables[b, p // BS]), p % BS
            if torch.isnan(k_cache[block, off]).any():
                k_cache[block, off] = torch.randn(KVH, D, generator=g)
                v_cache[block, off] = torch.randn(KVH, D, generator=g)
    q_lens = [min(n, int(L)) for n, L in zip(q_lens, lens)]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D, generator=g)
    return q, k_cache, v_cache, tables, qsl, lens


@needs_prefill_kernel
@pytest.mark.parametrize("H, KVH", [(4, 4), (9, 3), (16, 2)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("D", [64, 128, 32])
@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("strided", [False, True])
def test_prefill_kernel_matches_reference(H, KVH, D, BS, strided, isa):
    q, k_cache, v_cache, tables, qsl, lens = _prefill_case(H, KVH, D, BS, seed=H * D + BS, strided=strided)
    scale = D**-0.5
    got = prefill_kernel(q, k_cache, v_cache, tables, qsl, lens, scale)
    want = reference.paged_prefill_ref(q, k_cache, v_cache, tables, qsl, lens, scale)
    assert got.shape == q.shape and torch.isfinite(got).all()  # no NaN slot was read
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_prefill_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("q_len, ctx", [(37, 50), (2, 2), (1, 33)])
def test_prefill_kernel_splits_a_lone_sequence_in_chunks_of_rows(q_len, ctx, threads, isa):
    # One sequence, 3 KV heads: fewer (sequence, head) pairs than 4 per thread, so each head's rows are
    # split over several tasks (up to as many as it has 3-row tiles).
    g = torch.Generator().manual_seed(q_len * 100 + ctx)
    k_cache, v_cache = torch.randn(8, 16, 3, 64, generator=g), torch.randn(8, 16, 3, 64, generator=g)
    tables = torch.randperm(8, generator=g)[:4].view(1, 4).int()
    q = torch.randn(q_len, 9, 64, generator=g)
    qsl, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = prefill_kernel(q, k_cache, v_cache, tables, qsl, lens, 0.125)
    finally:
        torch.set_num_threads(old)
    torch.testing.assert_close(
        got, reference.paged_prefill_ref(q, k_cache, v_cache, tables, qsl, lens, 0.125), rtol=1e-5, atol=2e-6
    )


def _one_sequence(L, BS, D=64, KVH=3, H=9, seed=0):
    """Caches holding L positions of one sequence (its blocks scattered, NaN elsewhere) and a query row for each."""
    g = torch.Generator().manual_seed(seed)
    blocks = (L + BS - 1) // BS
    k_cache = torch.full((blocks + 3, BS, KVH, D), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    table = torch.randperm(blocks + 3, generator=g)[:blocks].int()
    for p in range(L):
        k_cache[table[p // BS], p % BS] = torch.randn(KVH, D, generator=g)
        v_cache[table[p // BS], p % BS] = torch.randn(KVH, D, generator=g)
    return torch.randn(L, H, D, generator=g), k_cache, v_cache, table


@needs_prefill_kernel
@pytest.mark.parametrize("BS", [16, 32])
@pytest.mark.parametrize("D, KVH, H", [(64, 3, 9), (128, 2, 4), (32, 1, 8)])
def test_prefill_kernel_long_context_matches_reference(BS, D, KVH, H, isa):
    # 130 new rows after 200 cached positions: many row tiles and key blocks, a head's rows split into tasks.
    q, k_cache, v_cache, table = _one_sequence(330, BS, D, KVH, H, seed=BS + D)
    args = (
        q[200:],
        k_cache,
        v_cache,
        table[None],
        torch.tensor([0, 130], dtype=torch.int32),
        torch.tensor([330], dtype=torch.int32),
        D**-0.5,
    )
    got = prefill_kernel(*args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, reference.paged_prefill_ref(*args), rtol=1e-5, atol=2e-6)


@needs_prefill_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_rows_do_not_depend_on_chunking_batching_or_threads(threads, isa):
    """A row's output is a function of its query and the positions it sees: the same bits whether the prompt
    is prefilled at once or in chunks, alone or beside another sequence, on any number of threads."""
    L, cut = 150, 70
    q, k_cache, v_cache, table = _one_sequence(L, 16, seed=7)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        whole = prefill_kernel(
            q,
            k_cache,
            v_cache,
            table[None],
            torch.tensor([0, L], dtype=torch.int32),
            torch.tensor([L], dtype=torch.int32),
            0.125,
        )
        first = prefill_kernel(
            q[:cut],
            k_cache,
            v_cache,
            table[None],
            torch.tensor([0, cut], dtype=torch.int32),
            torch.tensor([cut], dtype=torch.int32),
            0.125,
        )
        second = prefill_kernel(
            q[cut:],
            k_cache,
            v_cache,
            table[None],
            torch.tensor([0, L - cut], dtype=torch.int32),
            torch.tensor([L], dtype=torch.int32),
            0.125,
        )
        both = prefill_kernel(
            q,
            k_cache,
            v_cache,
            table[None].repeat(2, 1),
            torch.tensor([0, cut, L], dtype=torch.int32),
            torch.tensor([cut, L], dtype=torch.int32),
            0.125,
        )
    finally:
        torch.set_num_threads(old)
    assert torch.equal(torch.cat([first, second]), whole) and torch.equal(both, whole)


@needs_prefill_kernel
def test_prefill_entry_point_runs_the_kernel_where_it_applies(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "paged_prefill_ref", lambda *a: calls.append(a[0].shape) or torch.zeros_like(a[0]))
    q, k_cache, v_cache, tables, qsl, lens = _prefill_case(9, 3, 64, 16, seed=3)
    got = cpu_kernels.paged_prefill_cpu(q, k_cache, v_cache, tables, qsl, lens, 0.125)
    assert not calls and got.abs().sum() > 0  # fp32, head_dim 64: the kernel
    cpu_kernels.paged_prefill_cpu(
        q[..., :24].contiguous(), k_cache[..., :24], v_cache[..., :24], tables, qsl, lens, 0.2
    )
    cpu_kernels.paged_prefill_cpu(q.half(), k_cache.half(), v_cache.half(), tables, qsl, lens, 0.125)
    assert len(calls) == 2  # head_dim 24 and fp16: the reference


@needs_prefill_kernel
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a.update(seq_lens=a["seq_lens"].clone().fill_(0)), "outside"),
        (lambda a: a.update(seq_lens=a["seq_lens"].clone().fill_(10**4)), "outside"),
        (lambda a: a["block_tables"].__setitem__((1, 0), 10**4), "not a cache block"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"] + 1), "from 0 to T"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), "int32"),
        (lambda a: a.update(q=a["q"].double()), "float32"),
        (
            lambda a: a.update(q=a["q"][..., :16], k_cache=a["k_cache"][..., :16], v_cache=a["v_cache"][..., :16]),
            "multiple of 32",
        ),
    ],
)
def test_prefill_kernel_rejects_bad_input_with_a_clear_error(change, message):
    q, k_cache, v_cache, tables, qsl, lens = _prefill_case(4, 2, 32, 16, seed=4)
    args = {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "query_start_loc": qsl,
        "seq_lens": lens,
    }
    change(args)
    with pytest.raises(RuntimeError, match=message):
        prefill_kernel(*args.values(), 0.25)


def _loaded_linear(K: int, N: int, bias: bool) -> Linear:
    lin = Linear(K, N, bias)
    with torch.inference_mode():
        lin.load(torch.randn(N, K), torch.randn(N) if bias else None)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(
    "rows, path",
    [
        (1, "kernel"),
        (7, "kernel"),
        (cpu_kernels.MAX_LINEAR_ROWS, "kernel"),
        (1, "split_bmm"),
        (7, "onednn"),
        (cpu_kernels.MAX_LINEAR_ROWS + 1, "onednn"),
    ],
)
def test_linear_cpu_paths_match_f_linear(rows, path, bias, with_residual):
    lin = _loaded_linear(576, 960, bias)
    assert lin._kernel is kernel  # repack picks the kernel whenever it is there
    if path == "kernel" and kernel is None:
        pytest.skip("kernel not built")
    if path in ("split_bmm", "onednn"):
        lin._kernel = None  # what a machine without the kernel runs (and any machine above MAX_LINEAR_ROWS)
    x, residual = torch.randn(rows, 576), torch.randn(rows, 960) if with_residual else None
    with torch.inference_mode():
        got = lin(x, residual)
        want = F.linear(x, lin.weight, lin.bias) + (0 if residual is None else residual)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_linear_runs_more_rows_than_max_linear_rows_as_kernel_slices_with_the_same_bits():
    """A row's result does not depend on how many rows share the call (speculative decoding's rows, decode
    rows beside a long prefill chunk): past MAX_LINEAR_ROWS the kernel runs on slices, not oneDNN."""
    if kernel is None:
        pytest.skip("kernel not built")
    lin = _loaded_linear(64, 48, bias=True)
    calls = []
    lin._kernel = lambda x, *args: calls.append(x.shape[0]) or kernel(x, *args)
    max_rows = cpu_kernels.MAX_LINEAR_ROWS
    x, residual = torch.randn(2 * max_rows + 7, 64), torch.randn(2 * max_rows + 7, 48)
    with torch.inference_mode():
        together = lin(x, residual)
        alone = torch.cat([lin(x[i : i + 1], residual[i : i + 1]) for i in (0, max_rows, 2 * max_rows + 6)])
    assert calls[:3] == [max_rows, max_rows, 7]
    assert torch.equal(together[[0, max_rows, 2 * max_rows + 6]], alone)


def test_linear_kernel_rows_take_the_kernel_and_the_rest_onednn_each_row_as_alone():
    """A step's decode rows (kernel_rows) get the bits of a decode step; its prompt rows the bits of
    oneDNN whatever the chunk: neither depends on the rest of the call."""
    if kernel is None:
        pytest.skip("kernel not built")
    lin = _loaded_linear(64, 48, bias=False)
    x, residual = torch.randn(300, 64), torch.randn(300, 48)
    with torch.inference_mode():
        mixed = lin(x, residual, kernel_rows=5)
        decode_alone = torch.cat([lin(x[i : i + 1], residual[i : i + 1], kernel_rows=1) for i in range(5)])
        prompt_chunks = torch.cat(
            [lin(x[5:40], residual[5:40], kernel_rows=0), lin(x[40:], residual[40:], kernel_rows=0)]
        )
    assert torch.equal(mixed[:5], decode_alone)
    assert torch.equal(mixed[5:], prompt_chunks)


@pytest.mark.parametrize("rows", [1, 5, 2048])
@pytest.mark.parametrize("path", ["kernel", "hypot"])
def test_rms_norm_cpu_paths_match_f_rms_norm(rows, path, monkeypatch):
    if path == "kernel" and layer_ops is None:
        pytest.skip("kernels not built")
    if path == "hypot":  # what runs without the kernels
        monkeypatch.setattr(cpu_kernels, "layer_ops_for", lambda *tensors: None)
    norm = RMSNorm(576, 1e-5)
    with torch.inference_mode():
        norm.load(torch.randn(576))
    assert norm.cpu_fp32
    x = torch.randn(rows, 576) * 3
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (576,), norm.weight, 1e-5), rtol=1e-5, atol=1e-5)
        tiny = torch.full((1, 576), 1e-4)  # where eps dominates mean(x^2)
        torch.testing.assert_close(norm(tiny), F.rms_norm(tiny, (576,), norm.weight, 1e-5), rtol=1e-5, atol=1e-6)


def test_rms_norm_off_cpu_fp32_uses_f_rms_norm():
    norm = RMSNorm(8, 1e-6)
    with torch.inference_mode():
        norm.load(torch.ones(8))
    norm.to(torch.float64)
    assert not norm.cpu_fp32
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6))


needs_layer_ops = pytest.mark.skipif(layer_ops is None, reason="the llm_cpu kernels could not be built here")


@needs_layer_ops
@pytest.mark.parametrize("T", [1, 5, 300])  # 300: split over threads
@pytest.mark.parametrize("C", [576, 100, 7])  # the 16-wide loop, its 8-wide part, the scalar tail
def test_rms_norm_op_matches_reference(T, C):
    x, w = torch.randn(T, C) * 4, torch.randn(C)
    torch.testing.assert_close(
        layer_ops.rms_norm(x, w, 1e-5), cpu_kernels.rms_norm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-6
    )


@needs_layer_ops
@pytest.mark.parametrize("T", [1, 16, 300])
@pytest.mark.parametrize("F_", [1536, 13])
def test_silu_mul_op_matches_reference(T, F_):
    gate_up = torch.randn(T, 2 * F_) * 6
    gate_up[0, :4] = torch.tensor([0.0, 90.0, -90.0, -1e-30])  # exp's clamps and its zero
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), cpu_kernels.silu_mul_ref(gate_up), rtol=1e-6, atol=1e-6)


def _rope_case(T, H, KVH, D, seed=0, num_blocks=8, BS=16):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    cos, sin = torch.randn(T, 1, D, generator=g), torch.randn(T, 1, D, generator=g)
    caches = torch.randn(2, num_blocks, BS, KVH, D, generator=g)
    slots = torch.randperm(num_blocks * BS, generator=g)[:T]
    slots[T // 2] = -1  # a padded row: not stored
    return qkv, cos, sin, caches, slots


@needs_layer_ops
@pytest.mark.parametrize("H, KVH", [(4, 4), (9, 3), (16, 2)])
@pytest.mark.parametrize("D", [64, 128, 20])  # 20: half not a multiple of 8 (the scalar loop)
@pytest.mark.parametrize("T", [1, 7, 100])
def test_rope_store_kv_op_matches_reference(H, KVH, D, T):
    qkv, cos, sin, caches, slots = _rope_case(T, H, KVH, D, seed=H + D + T)
    got_caches, want_caches = caches.clone(), caches.clone()
    got = layer_ops.rope_store_kv(qkv, cos, sin, got_caches[0], got_caches[1], slots, H, KVH)
    want = cpu_kernels.rope_store_kv_ref(qkv, cos, sin, want_caches[0], want_caches[1], slots, H, KVH)
    assert got.shape == (T, H, D)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_caches, want_caches, rtol=1e-6, atol=1e-6)  # and nothing else written
    if T > 1:
        assert not torch.equal(got_caches, caches)


def test_rope_store_kv_reference_is_the_models_rope_and_store():
    from backend.attention import apply_rope

    T, H, KVH, D = 6, 4, 2, 8
    qkv, cos, sin, caches, slots = _rope_case(T, H, KVH, D)
    q = cpu_kernels.rope_store_kv_ref(qkv, cos, sin, caches[0], caches[1], slots, H, KVH)
    x = qkv.view(T, H + 2 * KVH, D)
    torch.testing.assert_close(q, apply_rope(x[:, :H], cos, sin))
    keep = slots >= 0
    rows = caches.flatten(1, 2)[:, slots[keep]]  # (2, kept, KVH, D)
    torch.testing.assert_close(rows[0], apply_rope(x[keep, H : H + KVH], cos[keep], sin[keep]))
    torch.testing.assert_close(rows[1], x[keep, H + KVH :])


@needs_layer_ops
@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: a["slots"].__setitem__(0, 8 * 16), "beyond"),
        (lambda a: a.update(qkv=a["qkv"][:, :-1].contiguous()), "qkv must be"),
        (lambda a: a.update(H=5), "multiple"),
        (lambda a: a.update(slots=a["slots"].int()), "int64"),
        (lambda a: a.update(cos=a["cos"][:2]), "cos and sin"),
    ],
)
def test_rope_store_kv_op_rejects_bad_input_with_a_clear_error(change, message):
    qkv, cos, sin, caches, slots = _rope_case(4, 4, 2, 8)
    args = {"qkv": qkv, "cos": cos, "sin": sin, "slots": slots, "H": 4}
    change(args)
    with pytest.raises(RuntimeError, match=message):
        layer_ops.rope_store_kv(
            args["qkv"], args["cos"], args["sin"], caches[0], caches[1], args["slots"], args["H"], 2
        )


def test_layer_ops_for_takes_contiguous_cpu_fp32_only():
    x = torch.randn(4, 8)
    assert cpu_kernels.layer_ops_for(x) is layer_ops
    assert cpu_kernels.layer_ops_for(x, x.double()) is None
    assert cpu_kernels.layer_ops_for(x.t()) is None


@pytest.mark.skipif(cpu_kernels.decoder_layer() is None, reason="the llm_cpu kernels could not be built here")
@pytest.mark.parametrize("B", [1, 5])
def test_decode_step_through_the_fused_layer_equals_the_op_by_op_one(B, monkeypatch):
    # llm_cpu::decoder_layer runs LlamaDecoderLayer.forward's C++ ops in the same order: the same bits,
    # hidden states and cache writes alike.
    from backend.attention import AttentionMetadata
    from backend.models import llama
    from tests.engine_helpers import tiny_checkpoint

    ck = tiny_checkpoint()
    cfg = ck.config
    model = llama.LlamaForCausalLM(cfg)
    model.load_weights(ck.state_dict)
    BS, nb = 8, 4
    g = torch.Generator().manual_seed(B)
    caches = [
        tuple(torch.randn(B * nb, BS, cfg.num_key_value_heads, cfg.head_dim, generator=g) for _ in range(2))
        for _ in range(cfg.num_hidden_layers)
    ]
    tables = torch.randperm(B * nb, generator=g).view(B, nb).int()
    lens = torch.randint(1, nb * BS, (B,), generator=g, dtype=torch.int32)  # this step's token included
    pos = lens.long() - 1
    slots = tables[torch.arange(B), (pos // BS)].long() * BS + pos % BS
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_seqs=B,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=torch.arange(B + 1, dtype=torch.int32),
    )
    ids = torch.randint(0, cfg.vocab_size, (B,), generator=g)
    calls = []
    real = cpu_kernels.decoder_layer()
    monkeypatch.setattr(cpu_kernels, "decoder_layer", lambda: lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        fused_caches = [(k.clone(), v.clone()) for k, v in caches]
        fused = model(ids, pos, fused_caches, meta)
        assert len(calls) == cfg.num_hidden_layers  # the fused op did run, once per layer
        monkeypatch.setattr(llama, "cpu_decoder_layer", lambda *a: None)
        plain = model(ids, pos, caches, meta)
    assert torch.equal(fused, plain)
    for (fk, fv), (k, v) in zip(fused_caches, caches):
        assert torch.equal(fk, k) and torch.equal(fv, v)


@pytest.mark.skipif(layer_ops is None, reason="the llm_cpu kernels could not be built here")
@pytest.mark.parametrize("V", [1, 7, 8, 13, 49152])
def test_argmax_rows_matches_torch_argmax(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g)
    x[1] = torch.randint(0, 3, (V,), generator=g).float()  # ties: the first maximum wins
    x[2] = float("-inf")
    x[3, V // 2] = float("nan")  # a NaN is the maximum (torch's answer)
    x[4, -1] = 100.0  # in the vector loop's scalar tail when V % 8 != 0
    x[5, 0] = 100.0
    x[6, V // 3 :] = float("nan")
    x[7] = 0.0
    got = layer_ops.argmax_rows(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    assert layer_ops.argmax_rows(x[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        layer_ops.argmax_rows(x.double())
    with pytest.raises(RuntimeError, match=r"\(S, V\)"):
        layer_ops.argmax_rows(x[0])


@pytest.mark.skipif(layer_ops is None, reason="the llm_cpu kernels could not be built here")
@pytest.mark.parametrize("V", [1, 7, 8, 13, 40, 49152])
def test_logsumexp_rows_matches_torch_and_a_row_alone_gets_the_same_bits(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(9, V, generator=g) * 4
    x[2] = float("-inf")
    x[3, V // 2] = float("nan")
    x[4, -1] = 100.0  # in the scalar tail when V % 8 != 0
    x[5, 0] = -1e30
    got = layer_ops.logsumexp_rows(x)
    expected = x.logsumexp(dim=-1)
    assert torch.isnan(got[3]) and got[2] == float("-inf")
    keep = [0, 1, 4, 5, 6, 7, 8]
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(layer_ops.logsumexp_rows(x[i : i + 1]), got[i : i + 1]) for i in keep)
    assert layer_ops.logsumexp_rows(x[:0]).shape == (0,)
