"""The machine's read bandwidth, for the bounds the benchmarks print beside their figures."""

from __future__ import annotations

import statistics
import time

import torch

from kernels import cpu_kernels


def measure_read_bandwidth_gb_s(repeats: int = 10) -> dict[str, float]:
    """Read bandwidth over a 256 MB fp32 matrix (far beyond the caches), median of `repeats`, by three
    read patterns: torch.mv; a plain sum (a pure streaming read, what the memory system gives); the
    one-row kernel the engine uses (kernels/cpu_linear.cpp), where it is built. A bound should use the
    highest, so it is what this machine demonstrably reads, not what one library routine reaches
    (torch.mv reads 25-35% below a plain sum here)."""
    w = torch.randn(8192, 8192)
    x = torch.randn(1, 8192)
    reads = {"mv": lambda: torch.mv(w, x[0]), "sum": lambda: w.sum()}
    kernel = cpu_kernels.linear() if cpu_kernels.load() else None
    if kernel is not None:
        panels = cpu_kernels.pack_linear_weight(w)
        reads["kernel"] = lambda: kernel(x, panels, w.shape[0])
    result = {}
    for name, read in reads.items():
        for _ in range(2):
            read()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            read()
            times.append(time.perf_counter() - t0)
        result[name] = w.numel() * 4 / statistics.median(times) / 1e9
    return result
