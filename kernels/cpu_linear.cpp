// llm_cpu::linear: y = x @ W.T (+ bias) (+ residual) for a FEW rows x (decode batches), fp32, AVX2 + FMA,
// and AVX-512 where the CPU has it (cpu_linear_avx512.cpp; the tiles themselves: cpu_linear_tiles.h).
//
// Why kernels of our own: a decode step multiplies each weight matrix by one row per running sequence.
// At 1-8 rows that is bound by reading the weights, and the library routines read SmolLM2's small
// matrices (1-7 MB) slowly (torch.mv, F.linear, oneDNN's packed linear: 11-15 GB/s where a 256 MB matrix
// reads at 20-30). Here each thread reads its weight rows as several sequential streams far apart
// (weight_rows below), and each tile multiplies MB x rows by NB weight rows held in registers:
//   - one row: 1 x 8 (8 streams, 8 independent accumulators);
//   - AVX2 (16 registers): two rows 2 x 4; three and more 3 x 4 tiles, the 1-2 rows left over in a
//     smaller tile; AVX-512 (32 registers): up to 6 x 4, the x rows in passes of equal size;
//   the sums reduced 4 at a time, in one order whatever the tile, so a row's result does not depend on
//   the batch it is in. The weight rows of a tile are read from memory once per call, then from L1 for
//   the other x rows.
// Measured on cpu_linear_bench.py's workload (30 layers of SmolLM2 matrices, an Intel Xeon VM with
// AVX-512, 2 threads, old and new builds alternating in one process): 1 row 30.7 -> 19.0 ms
// (13.8 -> 22.4 GB/s), 2-4 rows 1.5x, 8 rows 1.23x, 16 rows 1.2x faster than adjacent rows in one stream;
// the AVX-512 tiles then 1.1-1.3x faster than the AVX2 ones from 5 rows up (16 rows: 49.7 -> 38.7 ms, where
// oneDNN's AVX-512 GEMM takes 50.6).
// Output rows are split in contiguous ranges of weight rows over torch's intra-op threads
// (at::parallel_for), so torch.set_num_threads governs it like every other op.
// Built at first use by kernels/cpu_kernels.py; benchmarks/cpu_linear_bench.py measures it.

#include <immintrin.h>

#include <atomic>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_linear_tiles.h"

namespace llm_cpu {
void linear_rows_avx512(const LinearArgs& p, int64_t n0, int64_t n1);  // cpu_linear_avx512.cpp
}

namespace {

using llm_cpu::Avx2;
using llm_cpu::LinearArgs;
using llm_cpu::weight_rows;

// Whether calls take the AVX-512 tiles: where the CPU has AVX-512, unless switched off (linear_use_avx512).
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
std::atomic<bool> use_avx512{cpu_has_avx512()};

void linear_rows_avx2(const LinearArgs& p, int64_t n0, int64_t n1) {
  if (p.M == 1) {
    weight_rows<Avx2, 1, 8>(p, n0, n1);
  } else if (p.M == 2) {
    weight_rows<Avx2, 2, 4>(p, n0, n1);
  } else {
    weight_rows<Avx2, 3, 4>(p, n0, n1);
  }
}

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// x (M, K), weight (N, K), bias (N,) or None, residual (M, N) or None -> (M, N)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  check_tensor(x, "x");
  check_tensor(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be (M, K) and weight (N, K)");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, weight has ", K);
  if (bias) {
    check_tensor(*bias, "bias");
    TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements");
  }
  if (residual) {
    check_tensor(*residual, "residual");
    TORCH_CHECK(residual->numel() == M * N, "residual must have ", M, " x ", N, " elements");
  }
  at::Tensor y = at::empty({M, N}, x.options());
  const LinearArgs p{weight.const_data_ptr<float>(), x.const_data_ptr<float>(),
                     bias ? bias->const_data_ptr<float>() : nullptr,
                     residual ? residual->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), M, N, K};
  const auto rows = use_avx512.load(std::memory_order_relaxed) ? llm_cpu::linear_rows_avx512 : linear_rows_avx2;
  // A grain of 64 weight rows: a 576-row matrix still splits over 2 threads, and no thread gets a sliver.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { rows(p, begin, end); });
  return y;
}

// Switches the AVX-512 tiles on or off (for tests and A/B runs); on only where the CPU has AVX-512.
// Returns whether they are on now.
bool linear_use_avx512(bool enable) {
  use_avx512 = enable && cpu_has_avx512();
  return use_avx512;
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("linear_use_avx512(bool enable) -> bool", &linear_use_avx512);
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("linear", linear); }
