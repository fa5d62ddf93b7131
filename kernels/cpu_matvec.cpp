// llm_cpu::matvec: y = x @ W.T (+ bias) (+ residual) for ONE row x, fp32, AVX2 + FMA, on CPU.
//
// Why a kernel of our own: batch-1 decode on a CPU is a chain of matrix-vector products over fp32
// weights, bound by memory bandwidth. MKL's sgemv reads SmolLM2's small matrices (1-7 MB) at 7-8 GB/s
// on one core (torch.mv) and its batched form (Linear's split bmm) at 13-14 GB/s on two; this loop,
// one row after another in memory order with 8 independent accumulators, reads them at 15-16.5 GB/s.
// Rows are split in contiguous ranges over torch's intra-op threads (at::parallel_for), so
// torch.set_num_threads governs it like every other op. Built at first use by kernels/cpu_matvec.py.

#include <immintrin.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// y[n] = dot(W[n, :K], x[:K]) (+ bias[n]) (+ residual[n]) for n in [n0, n1); W row-major (N, K).
void dot_rows(const float* W, const float* x, const float* bias, const float* residual, float* y, int64_t K,
              int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = W + n * K;
    // 8 accumulators: enough independent FMAs in flight that the loop waits on memory, not on FMA latency.
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      for (int i = 0; i < 8; ++i) {
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8 * i), _mm256_loadu_ps(x + k + 8 * i), acc[i]);
      }
    }
    for (; k + 8 <= K; k += 8) acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc[0]);
    for (int i = 1; i < 8; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    float s = horizontal_sum(acc[0]);
    for (; k < K; ++k) s += w[k] * x[k];
    if (bias) s += bias[n];
    if (residual) s += residual[n];
    y[n] = s;
  }
}

void check_vector(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
  TORCH_CHECK(t.is_contiguous() && t.numel() == n, name, " must be contiguous with ", n, " elements");
}

// x (1, K), weight (N, K), bias (N,) or None, residual (1, N) or None -> (1, N)
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous (N, K) matrix");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat, "weight must be CPU float32");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1, "x must be one row (1, K)");
  check_vector(x, K, "x");
  if (bias) check_vector(*bias, N, "bias");
  if (residual) check_vector(*residual, N, "residual");
  at::Tensor y = at::empty({1, N}, x.options());
  const float* W = weight.const_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  const float* bp = bias ? bias->const_data_ptr<float>() : nullptr;
  const float* rp = residual ? residual->const_data_ptr<float>() : nullptr;
  float* yp = y.mutable_data_ptr<float>();
  // A grain of 64 rows: a 576-row matrix still splits over 2 threads, and no thread gets a sliver.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) { dot_rows(W, xp, bp, rp, yp, K, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY(llm_cpu, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("matvec", matvec); }
