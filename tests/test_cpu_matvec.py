"""The one-row CPU matvec kernel (kernels/cpu_matvec.cpp) and the CPU fast paths of backend.llama.

Every path must give what torch gives: the kernel against `matvec_ref`, Linear's three CPU paths
(kernel, split-bmm fallback, oneDNN several-row) against F.linear, the CPU RMSNorm against F.rms_norm.
fp32 sums in a different order: tolerances are a few ulps of the result's magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.llama import Linear, RMSNorm
from kernels import cpu_matvec

matvec = cpu_matvec.load()
needs_kernel = pytest.mark.skipif(matvec is None, reason="llm_cpu::matvec could not be built here (see its log line)")

# (N, K): K with and without a multiple of 64 / 8 (the kernel's main loop and its tails), N below the
# parallel grain (one thread) and above it.
SHAPES = [(1, 8), (7, 13), (64, 576), (130, 1536), (1000, 70), (3, 1)]


def test_kernel_is_built_on_avx2_machines():
    # A machine that can run it and has a compiler must not silently fall back to the slower path.
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert matvec is not None


@needs_kernel
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_reference(N, K, with_bias, with_residual):
    g = torch.Generator().manual_seed(N * 1000 + K)
    x, w = torch.randn(1, K, generator=g), torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    residual = torch.randn(1, N, generator=g) if with_residual else None
    got = matvec(x, w, bias, residual)
    assert got.shape == (1, N)
    torch.testing.assert_close(got, cpu_matvec.matvec_ref(x, w, bias, residual), rtol=1e-5, atol=1e-5 * K**0.5)


@needs_kernel
def test_kernel_gives_the_same_result_on_any_thread_count():
    x, w = torch.randn(1, 576), torch.randn(3072, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matvec(x, w)
        torch.set_num_threads(2)
        two = matvec(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # rows are split between threads, never a row's sum


@needs_kernel
@pytest.mark.parametrize("case, message", [
    (lambda: matvec(torch.randn(1, 8, dtype=torch.float64), torch.randn(4, 8)), "float32"),
    (lambda: matvec(torch.randn(2, 8), torch.randn(4, 8)), "one row"),
    (lambda: matvec(torch.randn(1, 8), torch.randn(8, 4).T), "contiguous"),
    (lambda: matvec(torch.randn(1, 6), torch.randn(4, 8)), "8 elements"),
    (lambda: matvec(torch.randn(1, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
    (lambda: matvec(torch.randn(1, 8), torch.randn(4, 8), None, torch.randn(1, 5)), "residual"),
])
def test_kernel_rejects_bad_input_with_a_clear_error(case, message):
    with pytest.raises(RuntimeError, match=message):
        case()


def test_loader_honours_the_off_switch(monkeypatch):
    monkeypatch.setenv("LLM_CPU_MATVEC", "0")
    assert cpu_matvec.load.__wrapped__() is None  # the uncached body: the switch is read per process


def _loaded_linear(K: int, N: int, bias: bool) -> Linear:
    lin = Linear(K, N, bias)
    with torch.inference_mode():
        lin.load(torch.randn(N, K), torch.randn(N) if bias else None)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("path", ["kernel", "split_bmm"])
def test_linear_one_row_paths_match_f_linear(bias, with_residual, path):
    if path == "kernel" and matvec is None:
        pytest.skip("kernel not built")
    lin = _loaded_linear(576, 960, bias)
    assert lin._matvec is matvec  # repack picks the kernel whenever it is there
    if path == "split_bmm":
        lin._matvec = None  # what a machine without the kernel runs
    x, residual = torch.randn(1, 576), torch.randn(1, 960) if with_residual else None
    with torch.inference_mode():
        got = lin(x, residual)
        want = F.linear(x, lin.weight, lin.bias) + (0 if residual is None else residual)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 17])
def test_linear_several_rows_match_f_linear(rows):
    lin = _loaded_linear(576, 960, bias=True)
    x, residual = torch.randn(rows, 576), torch.randn(rows, 960)
    with torch.inference_mode():
        torch.testing.assert_close(lin(x, residual), F.linear(x, lin.weight, lin.bias) + residual, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 2048])
def test_rms_norm_cpu_path_matches_f_rms_norm(rows):
    norm = RMSNorm(576, 1e-5)
    with torch.inference_mode():
        norm.load(torch.randn(576))
    assert norm._scaled is not None  # CPU fp32: the hypot formulation runs
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
    assert norm._scaled is None
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.inference_mode():
        torch.testing.assert_close(norm(x), F.rms_norm(x, (8,), norm.weight, 1e-6))
