"""One-row fp32 matmuls on CPU: the engine's kernel (kernels/cpu_matvec.cpp) against torch's ways.

The workload is a batch-1 decode step's weight reading: SmolLM2-135M's per-layer matrices (qkv 960x576,
o 576x576, gate_up 3072x576, down 576x1536), 30 layers of distinct random weights (425 MB, far beyond
the caches), each multiplied by one row in layer order. For each way: the median time of a pass and
the weight bytes read per second. Alongside, a plain sum over a 256 MB tensor: the streaming read
bandwidth of the machine at that moment. Rounds alternate the ways, so drift hits all alike.

    .venv/bin/python benchmarks/matvec_bench.py [--rounds 3]

The last line is one JSON object: GB/s per way (median over rounds). Numbers, not tests.
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

from kernels import cpu_matvec  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2 layer's matrices
LAYERS = 30


def split_bmm(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """backend.llama.Linear's fallback: W viewed as (S, N/S, K), one bmm, each thread its own slice."""
    S, _, K = w.shape
    return torch.bmm(w, x.as_strided((S, K, 1), (0, 1, K)))


def ways() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]:
    """name -> (prepare the weight once, multiply one row by it)."""
    S = torch.get_num_threads()
    result = {
        "split_bmm": (lambda w: w.view(S, w.shape[0] // S, w.shape[1]), split_bmm),
        "torch_mv": (lambda w: w, lambda w, x: torch.mv(w, x[0])),
        "f_linear": (lambda w: w, lambda w, x: F.linear(x, w)),
        "onednn_packed": (lambda w: torch.ops.mkldnn._reorder_linear_weight(w, None),
                          lambda w, x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")),
    }
    kernel = cpu_matvec.load()
    if kernel is not None:
        result = {"matvec_kernel": (lambda w: w, lambda w, x: kernel(x, w)), **result}
    return result


def time_pass(weights: list[list[torch.Tensor]], multiply, xs: dict[int, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in weights:
            for w, (_, K) in zip(layer, SHAPES):
                multiply(w, xs[K])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sum_read_gb_s(big: torch.Tensor, repeats: int = 5) -> float:
    big.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t0)
    return big.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7, help="passes per way per round")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}", flush=True)
    plain = [[torch.randn(N, K) for N, K in SHAPES] for _ in range(LAYERS)]
    total_bytes = sum(N * K * 4 for N, K in SHAPES) * LAYERS
    xs = {K: torch.randn(1, K) for _, K in SHAPES}
    big = torch.empty(64 * 2**20).normal_()  # 256 MB
    results: dict[str, list[float]] = {}
    with torch.inference_mode():
        for w, (N, K) in zip(plain[0], SHAPES):  # every way computes the same product
            want = w @ xs[K][0]
            for name, (prepare, multiply) in ways().items():
                torch.testing.assert_close(multiply(prepare(w), xs[K]).reshape(-1), want, rtol=1e-4, atol=1e-3)
        for r in range(args.rounds):
            line = [f"round {r + 1}:"]
            for name, (prepare, multiply) in ways().items():
                prepared = [[prepare(w) for w in layer] for layer in plain]
                multiply(prepared[0][0], xs[SHAPES[0][1]])
                seconds = time_pass(prepared, multiply, xs, args.repeats)
                results.setdefault(name, []).append(total_bytes / seconds / 1e9)
                line.append(f"{name} {seconds * 1e3:.1f} ms ({results[name][-1]:.1f} GB/s)")
                del prepared
            results.setdefault("sum_256mb", []).append(sum_read_gb_s(big))
            line.append(f"sum {results['sum_256mb'][-1]:.1f} GB/s")
            print("  ".join(line), flush=True)
    summary = {name: round(statistics.median(v), 2) for name, v in results.items()}
    print(f"{total_bytes / 1e6:.0f} MB of weights per pass; median GB/s: "
          + ", ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    print(json.dumps({f"{k}_gb_s": v for k, v in summary.items()}))


if __name__ == "__main__":
    main()
