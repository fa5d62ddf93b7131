"""The few-row CPU linear kernel (kernels/cpu_linear.cpp) and the CPU fast paths of backend.llama.

Every path must give what torch gives: the kernel against `linear_ref`, Linear's three CPU paths
(kernel, split-bmm fallback, oneDNN) against F.linear, the CPU RMSNorm against F.rms_norm.
fp32 sums in a different order: tolerances are a few ulps of the result's magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.llama import Linear, RMSNorm
from kernels import cpu_linear

kernel = cpu_linear.load()
needs_kernel = pytest.mark.skipif(kernel is None, reason="llm_cpu::linear could not be built here (see its log line)")

# (N, K): K with and without a multiple of 64 / 8 (the kernel's main loops and their tails), N below
# the parallel grain (one thread) and above it, N not a multiple of the 3-row weight tiles.
SHAPES = [(1, 8), (7, 13), (64, 576), (130, 1536), (1000, 70), (3, 1)]
# M: one row (its own loop), 4-row tiles and their 1-3 row tails, the 3-weight-row tiles above 8 rows.
ROWS = [1, 2, 3, 5, 8, 9, 14, 32]


def test_kernel_is_built_on_avx2_machines():
    # A machine that can run it and has a compiler must not silently fall back to the slower path.
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert kernel is not None


@needs_kernel
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("with_bias, with_residual", [(False, False), (True, False), (False, True), (True, True)])
def test_kernel_matches_reference(M, N, K, with_bias, with_residual):
    g = torch.Generator().manual_seed(M * 10**6 + N * 1000 + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    residual = torch.randn(M, N, generator=g) if with_residual else None
    got = kernel(x, w, bias, residual)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, cpu_linear.linear_ref(x, w, bias, residual), rtol=1e-5, atol=1e-5 * K**0.5)


@needs_kernel
@pytest.mark.parametrize("M", [1, 4, 12])
def test_kernel_gives_the_same_result_on_any_thread_count(M):
    x, w = torch.randn(M, 576), torch.randn(3072, 576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, w)
        torch.set_num_threads(2)
        two = kernel(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # weight rows are split between threads, never a dot product


@needs_kernel
@pytest.mark.parametrize("case, message", [
    (lambda: kernel(torch.randn(1, 8, dtype=torch.float64), torch.randn(4, 8)), "float32"),
    (lambda: kernel(torch.randn(2, 8, 1), torch.randn(4, 8)), r"\(M, K\)"),
    (lambda: kernel(torch.randn(1, 8), torch.randn(8, 4).T), "contiguous"),
    (lambda: kernel(torch.randn(1, 6), torch.randn(4, 8)), "6 columns"),
    (lambda: kernel(torch.randn(1, 8), torch.randn(4, 8), torch.randn(3)), "bias"),
    (lambda: kernel(torch.randn(2, 8), torch.randn(4, 8), None, torch.randn(1, 4)), "residual"),
])
def test_kernel_rejects_bad_input_with_a_clear_error(case, message):
    with pytest.raises(RuntimeError, match=message):
        case()


def test_loader_honours_the_off_switch(monkeypatch):
    monkeypatch.setenv("LLM_CPU_LINEAR", "0")
    assert cpu_linear.load.__wrapped__() is None  # the uncached body: the switch is read per process


def _loaded_linear(K: int, N: int, bias: bool) -> Linear:
    lin = Linear(K, N, bias)
    with torch.inference_mode():
        lin.load(torch.randn(N, K), torch.randn(N) if bias else None)
    return lin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows, path", [(1, "kernel"), (7, "kernel"), (cpu_linear.MAX_ROWS, "kernel"),
                                        (1, "split_bmm"), (7, "onednn"), (cpu_linear.MAX_ROWS + 1, "onednn")])
def test_linear_cpu_paths_match_f_linear(rows, path, bias, with_residual):
    lin = _loaded_linear(576, 960, bias)
    assert lin._kernel is kernel  # repack picks the kernel whenever it is there
    if path == "kernel" and kernel is None:
        pytest.skip("kernel not built")
    if path in ("split_bmm", "onednn"):
        lin._kernel = None  # what a machine without the kernel runs (and any machine above MAX_ROWS)
    x, residual = torch.randn(rows, 576), torch.randn(rows, 960) if with_residual else None
    with torch.inference_mode():
        got = lin(x, residual)
        want = F.linear(x, lin.weight, lin.bias) + (0 if residual is None else residual)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_linear_uses_the_kernel_up_to_max_rows_only(monkeypatch):
    if kernel is None:
        pytest.skip("kernel not built")
    lin = _loaded_linear(64, 48, bias=False)
    calls = []
    lin._kernel = lambda x, *args: calls.append(x.shape[0]) or kernel(x, *args)
    with torch.inference_mode():
        for rows in (1, 2, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 200):
            lin(torch.randn(rows, 64))
    assert calls == [1, 2, cpu_linear.MAX_ROWS]


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
