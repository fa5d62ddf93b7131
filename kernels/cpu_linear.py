"""The few-row fp32 CPU linear kernel (cpu_linear.cpp): build, load, and the torch reference.

`load()` returns the op `llm_cpu::linear(x (M, K), weight (N, K), bias (N,)?, residual (M, N)?) -> (M, N)`,
or None where it cannot run: a CPU without AVX2, no C++ compiler, a failed build, or LLM_CPU_LINEAR=0.
It is meant for decode batches, M <= MAX_ROWS (above, oneDNN's GEMM is faster: prefill); callers use
torch where it is None (backend.llama.Linear); `linear_ref` is the result both must give.

Built with torch.utils.cpp_extension at first use into `$LLM_CACHE_DIR/cpu_kernels` (default
`<repo>/.cache/cpu_kernels`): about 20 s once, then milliseconds per process (rebuilt when the source
changes). `make test` and `make serve` build it up front (`python -m kernels.cpu_linear`), so neither
a test nor the Triton model's start waits for the compiler.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
CpuLinear = Callable[..., torch.Tensor]
# Above this many rows oneDNN's packed GEMM beats the kernel's tiles (benchmarks/cpu_linear_bench.py).
MAX_ROWS = 32


def build_dir() -> Path:
    return Path(os.environ.get("LLM_CACHE_DIR") or SOURCE.parents[1] / ".cache") / "cpu_kernels"


@functools.cache
def load() -> CpuLinear | None:
    """The compiled op (built on the first call in any process), or None with the reason logged."""
    if os.environ.get("LLM_CPU_LINEAR", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("no AVX2 on this CPU: decode matmuls use torch")
        return None
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load as build

        build_dir().mkdir(parents=True, exist_ok=True)
        build(name="llm_cpu_linear", sources=[str(SOURCE)], build_directory=str(build_dir()),
              extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
              is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path, which is correct
        logger.warning("CPU linear kernel not built (%s: %s); decode matmuls use torch", type(exc).__name__, exc)
        return None
    torch.library.register_fake("llm_cpu::linear")(_linear_fake)  # shapes for torch.compile's tracing
    return torch.ops.llm_cpu.linear.default


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T (+ bias (N,)) (+ residual (M, N)) -> (M, N)."""
    y = x @ weight.T  # (M, N)
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


def _linear_fake(x, weight, bias=None, residual=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the venv's ninja (requirements.txt) is not on it unless
    the venv is activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


if __name__ == "__main__":  # `python -m kernels.cpu_linear`: build now (the Makefile does, before tests and serving)
    logging.basicConfig(level=logging.INFO)
    print("llm_cpu::linear", "ready" if load() is not None else "unavailable: decode matmuls use torch")
