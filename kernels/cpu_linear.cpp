// llm_cpu::linear: y = x @ W.T (+ bias) (+ residual) for a FEW rows x (decode batches), fp32, AVX2 + FMA.
//
// Why kernels of our own: a decode step multiplies each weight matrix by one row per running sequence.
// At 1-8 rows that is bound by reading the weights, and the library routines read SmolLM2's small
// matrices (1-7 MB) slowly: torch.mv at 7-8 GB/s, Linear's split bmm at 13-14, oneDNN's packed linear
// (what several rows ran on) at 10. Here:
//   - one row: the rows of W in memory order, 8 independent accumulators, 15-16.5 GB/s;
//   - 2 and more rows: tiles of 4 x-rows by 1 weight row (above 8 x-rows, where the arithmetic starts
//     to count: 3 x-rows by 4 weight rows, their sums reduced 4 at a time), so each weight row is read
//     from memory once per call. At 5-16 x rows the first pass over a tile's weight rows also
//     prefetches the next tile's, so their first pass does not wait on memory: 5-8 rows 15-19% faster,
//     10-16 rows 3-7% (the two builds alternating in one process on cpu_linear_bench.py's workload); at 3 rows it measured
//     slower, above 16 no better.
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

// One x row: y[n] for n in [n0, n1).
void one_row(const Problem& p, int64_t n0, int64_t n1) {
  const float* x = p.X;
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = p.W + n * p.K;
    // 8 accumulators: enough independent FMAs in flight that the loop waits on memory, not on FMA latency.
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= p.K; k += 64) {
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * i), _mm256_loadu_ps(x + k + 8 * i), acc[i]);
      }
    }
    for (; k + 8 <= p.K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc[0]);
    for (int i = 1; i < 8; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    float s = horizontal_sum(acc[0]);
    for (; k < p.K; ++k) s += w[k] * x[k];
    p.Y[n] = p.epilogue(s, 0, n);
  }
}

constexpr int64_t PREFETCH_ROWS[2] = {5, 16};

// x rows [m0, m0 + MB) times weight rows [n0, n0 + NB): MB * NB accumulators, each loaded vector used
// NB (x) or MB (weight) times.
template <int MB, int NB>
void tile(const Problem& p, int64_t m0, int64_t n0, const char* prefetch) {
  const int64_t K = p.K;
  __m256 acc[MB][NB];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if (prefetch) {  // NB * 32 bytes of the next NB weight rows per step: all of them over this pass
      for (int j = 0; j < NB * 32; j += 64) _mm_prefetch(prefetch + k * NB * 4 + j, _MM_HINT_T0);
    }
    __m256 w[NB];
    for (int j = 0; j < NB; ++j) w[j] = _mm256_loadu_ps(p.W + (n0 + j) * K + k);
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
      for (int64_t t = k; t < K; ++t) s += p.W[(n0 + j) * K + t] * p.X[(m0 + i) * K + t];
      p.Y[(m0 + i) * p.N + n0 + j] = p.epilogue(s, m0 + i, n0 + j);
    }
  }
}

// All x rows times weight rows [n0, n0 + NB): MB x rows at a time (4 by 1 weight row, 3 by 4, which
// fills the 16 vector registers), then the rows left.
template <int NB>
void weight_rows(const Problem& p, int64_t n0) {
  constexpr int MB = NB == 1 ? 4 : 3;
  // The first pass over these weight rows pulls the next ones toward L1 meanwhile (see the top).
  const bool prefetch = p.M >= PREFETCH_ROWS[0] && p.M <= PREFETCH_ROWS[1] && n0 + 2 * NB <= p.N;
  const char* next = prefetch ? reinterpret_cast<const char*>(p.W + (n0 + NB) * p.K) : nullptr;
  int64_t m = 0;
  for (; m + MB <= p.M; m += MB) tile<MB, NB>(p, m, n0, m == 0 ? next : nullptr);
  const char* pf = m == 0 ? next : nullptr;
  switch (p.M - m) {
    case 3: tile<3, NB>(p, m, n0, pf); break;
    case 2: tile<2, NB>(p, m, n0, pf); break;
    case 1: tile<1, NB>(p, m, n0, pf); break;
    default: break;
  }
}

template <int NB>
void several_rows(const Problem& p) {
  const int64_t blocks = p.N / NB;
  at::parallel_for(0, blocks, 64 / NB, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) weight_rows<NB>(p, b * NB);
  });
  for (int64_t n = blocks * NB; n < p.N; ++n) weight_rows<1>(p, n);
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
    // A grain of 64 rows: a 576-row matrix still splits over 2 threads, and no thread gets a sliver.
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { one_row(p, begin, end); });
  } else if (M <= 8) {
    several_rows<1>(p);
  } else {
    several_rows<4>(p);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("linear", linear); }
