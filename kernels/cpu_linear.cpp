// llm_cpu::linear: y = x @ W.T (+ bias) (+ residual) for a FEW rows x (decode batches), fp32, AVX2 + FMA.
//
// Why kernels of our own: a decode step multiplies each weight matrix by one row per running sequence.
// At 1-8 rows that is bound by reading the weights, and the library routines read SmolLM2's small
// matrices (1-7 MB) slowly (torch.mv, F.linear, oneDNN's packed linear: 11-15 GB/s where a 256 MB matrix
// reads at 20-30). Here each thread reads its weight rows as several sequential streams far apart
// (weight_rows below), and each tile multiplies MB x rows by NB weight rows held in registers:
//   - one row: 1 x 8 (8 streams, 8 independent accumulators);
//   - two rows: 2 x 4; three and more: 3 x 4 tiles, their sums reduced 4 at a time, the 1-2 rows left
//     over in a smaller tile. The weight rows of a tile are read from memory once per call, then from L1
//     for the other x rows.
// Measured on cpu_linear_bench.py's workload (30 layers of SmolLM2 matrices, an Intel Xeon VM with
// AVX-512, 2 threads, old and new builds alternating in one process): 1 row 30.7 -> 19.0 ms
// (13.8 -> 22.4 GB/s), 2-4 rows 1.5x, 8 rows 1.23x, 16 rows 1.2x faster than adjacent rows in one stream.
// Output rows are split in contiguous ranges of weight rows over torch's intra-op threads
// (at::parallel_for), so torch.set_num_threads governs it like every other op.
// Built at first use by kernels/cpu_kernels.py; benchmarks/cpu_linear_bench.py measures it.

#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_simd.h"

namespace {

using llm_cpu::horizontal_sum;

struct Problem {
  const float* W;         // (N, K) row-major
  const float* X;         // (M, K) row-major
  const float* bias;      // (N,) or null
  const float* residual;  // (M, N) or null
  float* Y;               // (M, N)
  int64_t M, N, K;

  float epilogue(float s, int64_t m, int64_t n) const {
    if (bias) s += bias[n];
    if (residual) s += residual[m * N + n];
    return s;
  }
};

// x rows [m0, m0 + MB) times the NB weight rows n, n + S, ..., n + (NB - 1) S: MB * NB accumulators,
// each loaded vector used NB (x) or MB (weight) times.
template <int MB, int NB>
void tile(const Problem& p, int64_t m0, int64_t n, int64_t S) {
  const int64_t K = p.K;
  const float* w_rows[NB];
  for (int j = 0; j < NB; ++j) w_rows[j] = p.W + (n + j * S) * K;
  __m256 acc[MB][NB];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm256_loadu_ps(w_rows[j] + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 x = _mm256_loadu_ps(p.X + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(w[j], x, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float sums[NB];
    if constexpr (NB == 4) {
      // The 4 dot products of an x row reduced together (3 hadds), not one horizontal sum each.
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[i][0], acc[i][1]), _mm256_hadd_ps(acc[i][2], acc[i][3]));
      _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    } else {
      for (int j = 0; j < NB; ++j) sums[j] = horizontal_sum(acc[i][j]);
    }
    for (int j = 0; j < NB; ++j) {
      float s = sums[j];
      for (int64_t t = k; t < K; ++t) s += w_rows[j][t] * p.X[(m0 + i) * K + t];
      p.Y[(m0 + i) * p.N + n + j * S] = p.epilogue(s, m0 + i, n + j * S);
    }
  }
}

// All x rows, MB at a time, times the weight rows n, n + S, ..., n + (NB - 1) S.
template <int MB, int NB>
void all_x_rows(const Problem& p, int64_t n, int64_t S) {
  int64_t m = 0;
  for (; m + MB <= p.M; m += MB) tile<MB, NB>(p, m, n, S);
  if constexpr (MB > 1) {
    switch (p.M - m) {
      case 2: tile<2, NB>(p, m, n, S); break;
      case 1: tile<1, NB>(p, m, n, S); break;
      default: break;
    }
  }
}

// One thread's weight rows [n0, n1), read as NB streams S rows apart (row i of stream j: n0 + j S + i),
// so that NB sequential reads in distant pages are in flight at once: the weights come from memory
// ~1.5x faster than one stream of adjacent rows (SmolLM2's rows are 2.3-6 KB, so a few adjacent rows
// lie in the same one or two 4 KB pages, which the hardware prefetcher walks one at a time).
template <int MB, int NB>
void weight_rows(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t S = (n1 - n0) / NB;
  for (int64_t i = 0; i < S; ++i) all_x_rows<MB, NB>(p, n0 + i, S);
  for (int64_t n = n0 + NB * S; n < n1; ++n) all_x_rows<MB, 1>(p, n, 0);
}

template <int MB, int NB>
void rows(const Problem& p) {
  // A grain of 64 weight rows: a 576-row matrix still splits over 2 threads, and no thread gets a sliver.
  at::parallel_for(0, p.N, 64, [&](int64_t begin, int64_t end) { weight_rows<MB, NB>(p, begin, end); });
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
  const Problem p{weight.const_data_ptr<float>(), x.const_data_ptr<float>(),
                  bias ? bias->const_data_ptr<float>() : nullptr,
                  residual ? residual->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), M, N, K};
  if (M == 1) {
    rows<1, 8>(p);
  } else if (M == 2) {
    rows<2, 4>(p);
  } else {
    rows<3, 4>(p);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("linear", linear); }
