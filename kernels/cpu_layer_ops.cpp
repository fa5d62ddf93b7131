// The element-wise steps of a decoder layer on CPU, fp32, AVX2 + FMA, one op each:
//   llm_cpu::rms_norm(x (T, C), weight (C,), eps) -> (T, C)
//   llm_cpu::rope_store_kv(qkv (T, (H + 2 KVH) * D), cos, sin (T, D), k_cache, v_cache (NB, BS, KVH, D),
//                          slot_mapping (T,) int64, H, KVH) -> q (T, H, D)
//   llm_cpu::silu_mul(gate_up (T, 2F)) -> silu(gate) * up (T, F)
//   llm_cpu::argmax_rows(x (S, V)) -> (S,) int64 (the sampler's greedy choice, as torch.argmax)
//   llm_cpu::logsumexp_rows(x (S, V)) -> (S,) fp32 (the logprobs' normalizer, as torch.logsumexp, the same
//                           bits for a row whatever rows share the call)
//
// Why: in a decode step the matmuls read the weights at the memory's speed, and what is left is
// dispatch: ~40 small torch ops per layer (4 for a norm; split, roll, mul, addcmul, two index_copy for
// rotary + cache store; chunk, silu, mul), a large share of a batch-1 step. Here they are 3 ops. Rows
// split over torch's intra-op threads (at::parallel_for) only when there are enough of them to pay for
// it. References (what the tests compare to): kernels.cpu_kernels.

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_simd.h"

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a CPU float32 tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Rows per task: about 16K elements, so a decode batch runs on the calling thread.
int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elems)); }

// x * weight / sqrt(mean(x^2) + eps), in HF's order: (x * inv_rms) * weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  const int64_t C = weight.numel();
  TORCH_CHECK(x.dim() == 2 && x.size(1) == C, "x must be (T, ", C, ")");
  const int64_t T = x.size(0);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.const_data_ptr<float>();
  const float* wp = weight.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, T, grain(C), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * C;
      float* yr = yp + t * C;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= C; c += 16) {
        const __m256 a = _mm256_loadu_ps(xr + c), b = _mm256_loadu_ps(xr + c + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
      }
      float ss = llm_cpu::horizontal_sum(_mm256_add_ps(acc0, acc1));
      for (; c < C; ++c) ss += xr[c] * xr[c];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(C) + static_cast<float>(eps));
      const __m256 vinv = _mm256_set1_ps(inv);
      c = 0;
      for (; c + 8 <= C; c += 8) {
        _mm256_storeu_ps(yr + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), vinv), _mm256_loadu_ps(wp + c)));
      }
      for (; c < C; ++c) yr[c] = (xr[c] * inv) * wp[c];
    }
  });
  return y;
}

// One head: out = x * cos + roll_half(x) * sin, roll_half(x) = (x[D/2:], x[:D/2]), with the signed sin
// table of backend/layers.py rope_tables (its first half negated).
inline void rope_head(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  if (half % 8 == 0) {
    for (int64_t d = 0; d < half; d += 8) {
      const __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + half + d);
      _mm256_storeu_ps(out + d, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + d)),
                                              _mm256_mul_ps(hi, _mm256_loadu_ps(sin + d))));
      _mm256_storeu_ps(out + half + d, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + d)),
                                                     _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + d))));
    }
    return;
  }
  for (int64_t d = 0; d < half; ++d) {
    const float lo = x[d], hi = x[half + d];
    out[d] = lo * cos[d] + hi * sin[d];
    out[half + d] = hi * cos[half + d] + lo * sin[half + d];
  }
}

// Rotary embedding of q and k, then k and v into their cache slots (a negative slot skips the token),
// from the fused projection's rows [q heads | k heads | v heads].
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t H, int64_t KVH) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1,
              "slot_mapping must be a CPU int64 vector");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "caches must be (num_blocks, block_size, KVH, D)");
  const int64_t D = k_cache.size(3), num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == KVH && H % KVH == 0, "H must be a multiple of the caches' ", k_cache.size(2), " KV heads");
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KVH) * D, "qkv must be (T, (H + 2 * KVH) * D)");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.numel() == T * D && sin.numel() == T * D, "cos and sin must be (T, D)");
  TORCH_CHECK(slot_mapping.numel() == T, "slot_mapping must have one slot per token");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // checked once, so the parallel loop cannot write outside the caches
    TORCH_CHECK(sp[t] < num_slots, "slot_mapping[", t, "] = ", sp[t], " is beyond the cache's ", num_slots, " slots");
  }
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const float* xp = qkv.const_data_ptr<float>();
  const float* cp = cos.const_data_ptr<float>();
  const float* snp = sin.const_data_ptr<float>();
  float* qp = q.mutable_data_ptr<float>();
  float* kp = k_cache.mutable_data_ptr<float>();
  float* vp = v_cache.mutable_data_ptr<float>();
  const int64_t row = (H + 2 * KVH) * D, kv_row = KVH * D;
  at::parallel_for(0, T, grain(row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* x = xp + t * row;
      const float* c = cp + t * D;
      const float* s = snp + t * D;
      for (int64_t h = 0; h < H; ++h) rope_head(x + h * D, c, s, qp + (t * H + h) * D, D);
      if (sp[t] < 0) continue;
      float* k = kp + sp[t] * kv_row;
      for (int64_t h = 0; h < KVH; ++h) rope_head(x + (H + h) * D, c, s, k + h * D, D);
      std::copy(x + (H + KVH) * D, x + row, vp + sp[t] * kv_row);
    }
  });
  return q;
}

// silu(gate) * up = gate / (1 + e^-gate) * up, gate and up the two halves of each row.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be (T, 2F)");
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor y = at::empty({T, F}, gate_up.options());
  const float* xp = gate_up.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, T, grain(2 * F), [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    for (int64_t t = begin; t < end; ++t) {
      const float* g = xp + t * 2 * F;
      const float* u = g + F;
      float* out = yp + t * F;
      int64_t f = 0;
      for (; f + 8 <= F; f += 8) {
        const __m256 gv = _mm256_loadu_ps(g + f);
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, llm_cpu::exp(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(out + f, _mm256_mul_ps(silu, _mm256_loadu_ps(u + f)));
      }
      for (; f < F; ++f) out[f] = g[f] / (1.f + std::exp(-g[f])) * u[f];
    }
  });
  return y;
}

// The largest value of row[0, V) (vector pass, scalar tail); has_nan: whether a NaN is among them.
float row_max(const float* row, int64_t V, bool& has_nan) {
  __m256 vmax = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 a = _mm256_loadu_ps(row + v);
    vmax = _mm256_max_ps(vmax, a);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  float m = llm_cpu::horizontal_max(vmax);
  has_nan = _mm256_movemask_ps(nan) != 0;
  for (; v < V; ++v) {
    has_nan |= std::isnan(row[v]);
    m = std::max(m, row[v]);
  }
  return m;
}

// The index of each row's largest value, the first one where several tie, the first NaN where there
// is one: torch.argmax's answer. x (S, V) -> (S,) int64. Two vector passes per row (the maximum, then
// where it first is), rows over threads: torch.argmax's reduction is scalar, one thread a row.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, "x must be (S, V) with V >= 1");
  const int64_t S = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({S}, x.options().dtype(at::kLong));
  const float* xp = x.const_data_ptr<float>();
  int64_t* op = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * V;
      bool has_nan = false;
      const float m = row_max(row, V, has_nan);
      int64_t found = 0;
      if (has_nan) {
        while (!std::isnan(row[found])) ++found;
      } else {
        const __m256 target = _mm256_set1_ps(m);
        int64_t v = 0;
        int mask = 0;
        for (; v + 8 <= V; v += 8) {
          if ((mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), target, _CMP_EQ_OQ))) != 0) break;
        }
        if (mask != 0) {
          found = v + __builtin_ctz(mask);
        } else {
          for (found = v; row[found] != m; ++found) {
          }
        }
      }
      op[s] = found;
    }
  });
  return out;
}

// log(sum(exp(x))) of each row, x (S, V) -> (S,) fp32, as torch.logsumexp: the maximum, then the sum of
// exp(x - max) in four 8-lane accumulators added in a fixed order. One thread a row, so a row's bits do
// not depend on how many rows share the call (torch splits a lone row over threads and sums it in another
// order). A row with a NaN gives NaN, a row of -inf gives -inf.
at::Tensor logsumexp_rows(const at::Tensor& x) {
  check_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) >= 1, "x must be (S, V) with V >= 1");
  const int64_t S = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({S}, x.options());
  const float* xp = x.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const float* row = xp + s * V;
      bool has_nan = false;
      const float m = row_max(row, V, has_nan);
      if (has_nan || m == -INFINITY || m == INFINITY) {
        op[s] = has_nan ? NAN : m;
        continue;
      }
      const __m256 vm = _mm256_set1_ps(m);
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      int64_t v = 0;
      for (; v + 32 <= V; v += 32)
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm256_add_ps(acc[j], llm_cpu::exp(_mm256_sub_ps(_mm256_loadu_ps(row + v + 8 * j), vm)));
      for (; v + 8 <= V; v += 8) acc[0] = _mm256_add_ps(acc[0], llm_cpu::exp(_mm256_sub_ps(_mm256_loadu_ps(row + v), vm)));
      float sum = llm_cpu::horizontal_sum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
      for (; v < V; ++v) sum += std::exp(row[v] - m);
      op[s] = m + std::log(sum);
    }
  });
  return out;
}

}  // namespace

at::Tensor llm_cpu::ops::rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
at::Tensor llm_cpu::ops::rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                       at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t H, int64_t KVH) {
  return ::rope_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, H, KVH);
}
at::Tensor llm_cpu::ops::silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("logsumexp_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rope_store_kv", rope_store_kv);
  m.impl("silu_mul", silu_mul);
  m.impl("argmax_rows", argmax_rows);
  m.impl("logsumexp_rows", logsumexp_rows);
}
