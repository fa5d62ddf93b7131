"""Decode-batch fp32 matmuls on CPU: the engine's kernel (kernels/cpu_linear.cpp) against torch's ways.

The workload is a decode step's weight reading: SmolLM2-135M's per-layer matrices (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536), 30 layers of distinct random weights (425 MB, far beyond
the caches), each multiplied by M rows in layer order, for M in --rows. The weights are random Q4 values
(d * q + m in every 32 k, as SmolLM2's GGUF holds them), so the kernel also runs on Q4 panels
(`kernel_q4`, 80 MB: its GB/s count the fp32 bytes it stands for). Per way and M: the median time
of a pass, the weight bytes read per second and GFLOP/s. After each round, the machine's read bandwidth
at that moment (benchmarks/bandwidth.py: torch.mv, a plain sum and the kernel over 256 MB). Ways
alternate within each round, so drift hits all alike. The crossover where oneDNN overtakes the kernel
sets kernels.cpu_kernels.MAX_LINEAR_ROWS; where the fp32 panels overtake the Q4 ones, Q4_MAX_ROWS.

    .venv/bin/python benchmarks/cpu_linear_bench.py [--rows 1 2 4 8 16 32 64 160 256] [--rounds 2]

The last line is one JSON object: {way: {M: GB/s}} (median over rounds). Numbers, not tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bandwidth import measure_read_bandwidth_gb_s
from kernels import cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2 layer's matrices
LAYERS = 30
Way = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def split_bmm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """backend.layers.Linear's one-row fallback: W viewed as (S, N/S, K), one bmm, each thread a slice."""
    S, _, K = w.shape
    return torch.bmm(w, x.as_strided((S, K, 1), (0, 1, K)))


def ways(rows: int) -> dict[str, Way]:
    """name -> (prepare the weight once, multiply `rows` rows by it)."""
    S = torch.get_num_threads()
    result: dict[str, Way] = {}
    kernel = cpu_kernels.linear() if cpu_kernels.load() else None
    if kernel is not None:
        result["kernel"] = (lambda w: (cpu_kernels.pack_linear_weight(w), w.shape[0]), lambda p, x: kernel(x, *p))
        result["kernel_q4"] = (lambda w: (cpu_kernels.pack_q4_weight(w), w.shape[0]), lambda p, x: kernel(x, *p))
    result["onednn_packed"] = (
        lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
        lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    )
    result["f_linear"] = (lambda w: w, lambda w, x: F.linear(x, w))
    if rows == 1:
        result["split_bmm"] = (lambda w: w.view(S, w.shape[0] // S, w.shape[1]), split_bmm)
        result["torch_mv"] = (lambda w: w, lambda w, x: torch.mv(w, x[0]))
    return result


def random_q4(N: int, K: int) -> torch.Tensor:
    """(N, K) weights that are d * q + m in every run of 32 k (fp16 d and m, q in 0..15; each block holds
    a 0 and a 15, as a quantizer's minimum and maximum give)."""
    d = (torch.rand(N, K // 32, 1) * 0.02).half().float()
    m = (-torch.rand(N, K // 32, 1) * 0.1).half().float()
    q = torch.randint(0, 16, (N, K // 32, 32)).float()
    q[..., 0], q[..., 1] = 0, 15
    return (d * q + m).reshape(N, K)


def time_pass(weights: list[list[torch.Tensor]], multiply, xs: dict[int, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in weights:
            for w, (_, K) in zip(layer, SHAPES):
                multiply(w, xs[K])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 160, 256])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="passes per way per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}",
        flush=True,
    )
    plain = [[random_q4(N, K) for N, K in SHAPES] for _ in range(LAYERS)]
    weight_bytes = sum(N * K * 4 for N, K in SHAPES) * LAYERS
    gb_s: dict[str, dict[int, list[float]]] = {}
    with torch.inference_mode():
        for w, (N, K) in zip(plain[0], SHAPES):  # every way computes the same product
            x = torch.randn(3, K)
            for rows in sorted({1, 3}):
                for prepare, multiply in ways(rows).values():
                    got = multiply(prepare(w), x[:rows]).reshape(rows, N)
                    torch.testing.assert_close(got, x[:rows] @ w.T, rtol=1e-4, atol=1e-3)
        for r in range(args.rounds):
            for rows in args.rows:
                xs = {K: torch.randn(rows, K) for _, K in SHAPES}
                line = [f"round {r + 1}, {rows:2d} rows:"]
                for name, (prepare, multiply) in ways(rows).items():
                    prepared = [[prepare(w) for w in layer] for layer in plain]
                    multiply(prepared[0][0], xs[SHAPES[0][1]])
                    seconds = time_pass(prepared, multiply, xs, args.repeats)
                    gb_s.setdefault(name, {}).setdefault(rows, []).append(weight_bytes / seconds / 1e9)
                    line.append(
                        f"{name} {seconds * 1e3:.1f} ms ({weight_bytes / seconds / 1e9:.1f} GB/s, "
                        f"{weight_bytes / 2 * rows / seconds / 1e9:.0f} GFLOP/s)"
                    )
                    del prepared
                print("  ".join(line), flush=True)
            reads = measure_read_bandwidth_gb_s()
            for name, value in reads.items():
                gb_s.setdefault(f"read_256mb_{name}", {}).setdefault(0, []).append(value)
            print(
                f"round {r + 1}: read bandwidth over 256 MB, GB/s: "
                + ", ".join(f"{name} {value:.1f}" for name, value in reads.items()),
                flush=True,
            )
    summary = {
        name: {m: round(statistics.median(v), 2) for m, v in per_rows.items()} for name, per_rows in gb_s.items()
    }
    print(f"{weight_bytes / 1e6:.0f} MB of weights per pass; median GB/s by rows: {summary}", flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
