"""The one-row fp32 CPU matrix-vector kernel (cpu_matvec.cpp): build, load, and the torch reference.

`load()` returns the op `llm_cpu::matvec(x (1, K), weight (N, K), bias (N,)?, residual (1, N)?) -> (1, N)`,
or None where it cannot run: a CPU without AVX2, no C++ compiler, a failed build, or LLM_CPU_MATVEC=0.
Callers then use torch (backend.llama.Linear's split bmm); `matvec_ref` is the result both must give.

Built with torch.utils.cpp_extension at first use into `$LLM_CACHE_DIR/cpu_kernels` (default
`<repo>/.cache/cpu_kernels`): about 20 s once, then milliseconds per process (rebuilt when the source
changes). `make test` and `make serve` build it up front (`python -m kernels.cpu_matvec`), so neither
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

SOURCE = Path(__file__).with_name("cpu_matvec.cpp")
Matvec = Callable[..., torch.Tensor]


def build_dir() -> Path:
    return Path(os.environ.get("LLM_CACHE_DIR") or SOURCE.parents[1] / ".cache") / "cpu_kernels"


@functools.cache
def load() -> Matvec | None:
    """The compiled op (built on the first call in any process), or None with the reason logged."""
    if os.environ.get("LLM_CPU_MATVEC", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        logger.info("no AVX2 on this CPU: one-row matmuls use torch")
        return None
    try:
        _ensure_ninja_on_path()
        from torch.utils.cpp_extension import load as build

        build_dir().mkdir(parents=True, exist_ok=True)
        build(name="llm_cpu_matvec", sources=[str(SOURCE)], build_directory=str(build_dir()),
              extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
              is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path, which is correct
        logger.warning("CPU matvec kernel not built (%s: %s); one-row matmuls use torch", type(exc).__name__, exc)
        return None
    torch.library.register_fake("llm_cpu::matvec")(_matvec_fake)  # shapes for torch.compile's tracing
    return torch.ops.llm_cpu.matvec.default


def matvec_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """x (1, K) @ weight (N, K).T (+ bias (N,)) (+ residual (1, N)) -> (1, N)."""
    y = x @ weight.T  # (1, N)
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


def _matvec_fake(x, weight, bias=None, residual=None):
    return x.new_empty(1, weight.shape[0])


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the venv's ninja (requirements.txt) is not on it unless
    the venv is activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


if __name__ == "__main__":  # `python -m kernels.cpu_matvec`: build now (the Makefile does, before tests and serving)
    logging.basicConfig(level=logging.INFO)
    print("llm_cpu::matvec", "ready" if load() is not None else "unavailable: one-row matmuls use torch")
