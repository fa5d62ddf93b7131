// llm_cpu::linear: y = x @ W.T (+ bias) (+ residual) for a FEW rows x (decode batches), fp32, AVX2 + FMA,
// and AVX-512 where the CPU has it (cpu_linear_avx512.cpp; the tiles themselves: cpu_linear_tiles.h).
// llm_cpu::pack_linear_weight lays W out for it once, at load time: panels of 32 output columns.
//
// Why kernels of our own: a decode step multiplies each weight matrix by one row per running sequence.
// At 1-4 rows that is bound by reading the weights, and the library routines read SmolLM2's small
// matrices (1-7 MB) well below the rate a large matrix reads at (torch.mv, F.linear, oneDNN's packed
// linear); at 8-160 rows by both the reading and the arithmetic, which must then overlap (up to
// MAX_LINEAR_ROWS these tiles also beat oneDNN's GEMM: short prefill chunks run here too).
// Here each panel is two sequential reads (even k, odd k), a tile takes several panels far apart at
// once where its registers allow (one row: 4 AVX-512, 3 AVX2), so several reads are in flight, and
// prefetches 4 KB ahead; it keeps up to 12 (AVX-512) or 3 (AVX2) x rows times 32 columns of sums in
// registers (see cpu_linear_tiles.h).
// Figures (benchmarks/cpu_linear_bench.py): docs/kernels.md.
// Output panels are split in contiguous ranges over torch's intra-op threads (at::parallel_for), so
// torch.set_num_threads governs it like every other op.
// Built and loaded by kernels/cpu_kernels.py (load()); benchmarks/cpu_linear_bench.py measures it.

#include <immintrin.h>

#include <atomic>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_linear_tiles.h"
#include "cpu_ops.h"

namespace llm_cpu {
void linear_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1);  // cpu_linear_avx512.cpp
void linear_q4_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1);
void linear_q8_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1);
}

namespace {

using llm_cpu::Avx2;
using llm_cpu::LinearArgs;
using llm_cpu::kPanel;

// Whether calls take the AVX-512 code (these tiles, paged_decode's path): where the CPU has AVX-512, unless
// switched off (use_avx512).
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
std::atomic<bool> use_avx512{cpu_has_avx512()};

void linear_panels_avx2(const LinearArgs& a, int64_t p0, int64_t p1) { llm_cpu::panels<Avx2>(a, p0, p1); }
void linear_q4_panels_avx2(const LinearArgs& a, int64_t p0, int64_t p1) {
  llm_cpu::quant_panels<Avx2, llm_cpu::Q4Format>(a, p0, p1);
}
void linear_q8_panels_avx2(const LinearArgs& a, int64_t p0, int64_t p1) {
  llm_cpu::quant_panels<Avx2, llm_cpu::Q8Format>(a, p0, p1);
}

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// weight (N, K) -> (ceil(N / 32), K, 32): panel p holds weight[32 p + c, k] at [p, r, c] with r = k / 2 for
// even k and (K + 1) / 2 + k / 2 for odd k (llm_cpu::kHalves), zeros past N.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  check_tensor(weight, "weight");
  TORCH_CHECK(weight.dim() == 2, "weight must be (N, K)");
  static_assert(llm_cpu::kHalves == 2, "the order below is even k, then odd k");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  at::Tensor padded = weight;
  if (P * kPanel != N) padded = at::cat({weight, weight.new_zeros({P * kPanel - N, K})});
  const at::Tensor k_order = at::cat({at::arange(0, K, 2, at::kLong), at::arange(1, K, 2, at::kLong)});
  return padded.view({P, kPanel, K}).transpose(1, 2).index_select(1, k_order).contiguous();  // (P, K, 32)
}

// x (M, K), packed weight of an (N, K) weight, bias (N,) or None, residual (M, N) or None -> (M, N). The packed
// weight is fp32 panels (P, K, 32) (pack_linear_weight), or uint8 Q4 panels (P, K / 32, kQ4BlockBytes) or
// Q8 panels (P, K / 32, kQ8BlockBytes) (cpu_linear_tiles.h; kernels.cpu_kernels.pack_q4_weight and
// pack_q8_weight): the same results, bit for bit.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual) {
  check_tensor(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be (M, K)");
  const bool quantized = packed.scalar_type() == at::kByte;
  const bool q8 = quantized && packed.dim() == 3 && packed.size(2) == llm_cpu::kQ8BlockBytes;
  if (quantized) {
    TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous(), "Q4/Q8 panels must be a contiguous CPU tensor");
    TORCH_CHECK(packed.dim() == 3 && (q8 || packed.size(2) == llm_cpu::kQ4BlockBytes), "Q4/Q8 panels must be (P, K / 32, ",
                llm_cpu::kQ4BlockBytes, " or ", llm_cpu::kQ8BlockBytes, ") bytes");
  } else {
    check_tensor(packed, "packed weight");
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel, "the weight must be packed by pack_linear_weight: (P, K, 32)");
  }
  const int64_t M = x.size(0), K = quantized ? packed.size(1) * llm_cpu::kQ4Block : packed.size(1), P = packed.size(0);
  TORCH_CHECK(N > (P - 1) * kPanel && N <= P * kPanel, "n = ", N, " does not fit a packed weight of ", P, " panels");
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
  const LinearArgs a{static_cast<const float*>(packed.const_data_ptr()), x.const_data_ptr<float>(),
                     bias ? bias->const_data_ptr<float>() : nullptr,
                     residual ? residual->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(), M, N, K};
  const bool wide = use_avx512.load(std::memory_order_relaxed);
  const auto run = q8          ? (wide ? llm_cpu::linear_q8_panels_avx512 : linear_q8_panels_avx2)
                   : quantized ? (wide ? llm_cpu::linear_q4_panels_avx512 : linear_q4_panels_avx2)
                               : (wide ? llm_cpu::linear_panels_avx512 : linear_panels_avx2);
  // A grain of 2 panels (64 columns): a 576-column matrix still splits over 2 threads, and no thread gets a sliver.
  at::parallel_for(0, P, 2, [&](int64_t begin, int64_t end) { run(a, begin, end); });
  return y;
}

// Switches the AVX-512 code on or off (for tests and A/B runs); on only where the CPU has AVX-512.
// Returns whether it is on now.
bool use_avx512_op(bool enable) {
  use_avx512 = enable && cpu_has_avx512();
  return use_avx512;
}

}  // namespace

bool llm_cpu::ops::avx512_on() { return use_avx512.load(std::memory_order_relaxed); }

at::Tensor llm_cpu::ops::linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  return ::linear(x, packed, n, bias, residual);
}

TORCH_LIBRARY(llm_cpu, m) {
  m.def("linear(Tensor x, Tensor packed_weight, int n, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def("use_avx512(bool enable) -> bool", &use_avx512_op);
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("linear", linear);
  m.impl("pack_linear_weight", pack_linear_weight);
}
