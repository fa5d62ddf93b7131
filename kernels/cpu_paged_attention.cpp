// llm_cpu::paged_decode: decode attention on CPU, fp32, reading K/V straight from the paged cache.
//
// One query token per sequence attends to its seq_lens[b] cached positions, found through its block
// table; grouped-query attention (the G = H / KVH query heads of a KV head share its K/V, read once).
// Exact softmax in two passes over a scores buffer (contexts on CPU are short enough to hold it).
// Why not the torch reference: it gathers every context into a padded copy (two index_select) and runs
// SDPA on tiny matrices, most of its time copies and per-call overhead. Work is split over sequences
// with at::parallel_for. Where the CPU has AVX-512 and the head shape fits, cpu_paged_attention_avx512.cpp
// runs instead, over (sequence, KV head) units split by work. Built with cpu_linear.cpp by
// kernels/cpu_kernels.py; the reference it must match is kernels.reference.paged_attention_decode_ref.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_ops.h"
#include "cpu_paged_checks.h"
#include "cpu_paged_decode_avx512.h"
#include "cpu_simd.h"

namespace {

using llm_cpu::horizontal_sum;

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  float s = horizontal_sum(acc);
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// The dot products of q with 8 K rows (k, k + stride, ..., D % 8 == 0): one accumulator per row, so 8
// independent FMA chains, then one transposing reduction that leaves the 8 sums in one vector. One dot
// at a time waited on each FMA's latency and paid a horizontal sum per position.
inline __m256 dot8(const float* q, const float* k, int64_t stride, int64_t D) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int p = 0; p < 8; ++p) acc[p] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + p * stride + d), acc[p]);
  }
  const __m256 h0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 h4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

inline void axpy(float alpha, const float* x, float* y, int64_t D) {  // y += alpha * x
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(y + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
  for (; d < D; ++d) y[d] += alpha * x[d];
}

// s = softmax(s) over L scores, in place.
inline void softmax(float* s, int64_t L) {
  int64_t t = 0;
  __m256 vm = _mm256_set1_ps(-INFINITY);
  for (; t + 8 <= L; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
  float m = llm_cpu::horizontal_max(vm);
  for (; t < L; ++t) m = std::max(m, s[t]);
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  t = 0;
  for (; t + 8 <= L; t += 8) {
    const __m256 e = llm_cpu::exp(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmax));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = horizontal_sum(vsum);
  for (; t < L; ++t) sum += (s[t] = std::exp(s[t] - m));
  const float inv = 1.f / sum;
  const __m256 vinv = _mm256_set1_ps(inv);
  t = 0;
  for (; t + 8 <= L; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), vinv));
  for (; t < L; ++t) s[t] *= inv;
}

// Asks for n cached positions' rows (all KV heads) from `block` on, a line at a time.
inline void prefetch_rows(const float* block, int64_t n, int64_t row_stride, int64_t head_stride, int64_t KVH, int64_t D) {
  const int64_t span = (KVH - 1) * head_stride + D;  // floats from a row's first head to its last one's end
  for (int64_t t = 0; t < n; ++t)
    for (int64_t f = 0; f < span; f += 16) _mm_prefetch(reinterpret_cast<const char*>(block + t * row_stride + f), _MM_HINT_T0);
}

// One sequence, for G (<= 4) query heads per KV head and D % 32 == 0 (SmolLM2: G = 3, D = 64): the G
// heads of a KV head go through its K and V rows together, so each loaded row serves G heads: faster than
// one head at a time (the general path below) on few long sequences; equal on many short ones, where
// the caches no longer fit in L2 and reading them bounds both.
//   q (H, D), scores (H, L) scratch, o (H, D).
template <int G>
void attend_grouped(const llm_cpu::PagedArgs& c, const int32_t* table, int64_t L, int64_t KVH, int64_t D, float scale,
                    const float* q, float* scores, float* o) {
  const __m128 vscale = _mm_set1_ps(scale);
  for (int64_t h = 0; h < KVH; ++h) {
    const float* qh = q + h * G * D;  // (G, D)
    float* sh = scores + h * G * L;   // (G, L)
    for (int64_t t0 = 0; t0 < L; t0 += c.BS) {
      const float* k = c.k + table[t0 / c.BS] * c.k_sb + h * c.k_sh;
      const int64_t n = std::min(L - t0, c.BS);
      if (h == 0 && t0 + c.BS < L) {  // the next K block, all heads, on the first head's pass
        prefetch_rows(c.k + table[t0 / c.BS + 1] * c.k_sb, std::min(L - t0 - c.BS, c.BS), c.k_so, c.k_sh, c.KVH, c.D);
      }
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {  // 4 positions x G heads: 4G accumulators
        __m256 acc[G][4];
        for (auto& row : acc)
          for (auto& a : row) a = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          __m256 kv[4];
          for (int p = 0; p < 4; ++p) kv[p] = _mm256_loadu_ps(k + (t + p) * c.k_so + d);
          for (int g = 0; g < G; ++g) {
            const __m256 qv = _mm256_loadu_ps(qh + g * D + d);
            for (int p = 0; p < 4; ++p) acc[g][p] = _mm256_fmadd_ps(qv, kv[p], acc[g][p]);
          }
        }
        for (int g = 0; g < G; ++g) {
          const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
          const __m128 r = _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
          _mm_storeu_ps(sh + g * L + t0 + t, _mm_mul_ps(r, vscale));
        }
      }
      for (; t < n; ++t) {
        for (int g = 0; g < G; ++g) sh[g * L + t0 + t] = dot(qh + g * D, k + t * c.k_so, D) * scale;
      }
    }
    for (int g = 0; g < G; ++g) softmax(sh + g * L, L);
    float* oh = o + h * G * D;  // (G, D)
    for (int64_t d0 = 0; d0 < D; d0 += 32) {  // 32 dims x G heads in registers over all positions
      __m256 acc[G][4];
      for (auto& row : acc)
        for (auto& a : row) a = _mm256_setzero_ps();
      for (int64_t t0 = 0; t0 < L; t0 += c.BS) {
        const float* v = c.v + table[t0 / c.BS] * c.v_sb + h * c.v_sh + d0;
        const int64_t n = std::min(L - t0, c.BS);
        for (int64_t t = 0; t < n; ++t) {
          __m256 vv[4];
          for (int j = 0; j < 4; ++j) vv[j] = _mm256_loadu_ps(v + t * c.v_so + 8 * j);
          for (int g = 0; g < G; ++g) {
            const __m256 a = _mm256_broadcast_ss(sh + g * L + t0 + t);
            for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_fmadd_ps(a, vv[j], acc[g][j]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(oh + g * D + d0 + 8 * j, acc[g][j]);
    }
  }
}

// The shapes decode_units_avx512 takes (cpu_paged_decode_avx512.h).
bool avx512_path_takes(int64_t G, int64_t D) {
  return (D == 32 && G >= 1 && G <= 8) || (D == 64 && G >= 1 && G <= 4) || (D == 128 && G >= 1 && G <= 2);
}

// Where T threads' ranges of the units u = b * KVH + h (sequence b's KV head h) start: contiguous ranges of
// about equal work (a unit's work ~ its positions + a fixed cost), so that no thread waits long for the
// other at the end. bounds[0] = 0, bounds[T] = B * KVH.
std::vector<int64_t> balanced_ranges(const int32_t* lens, int64_t B, int64_t KVH, int64_t T) {
  constexpr int64_t kUnitCost = 16;  // positions' worth of per-unit work (softmax setup, stores)
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += KVH * (lens[b] + kUnitCost);
  std::vector<int64_t> bounds(T + 1, B * KVH);
  bounds[0] = 0;
  int64_t done = 0, i = 1;
  for (int64_t u = 0; u < B * KVH; ++u) {
    const int64_t w = lens[u / KVH] + kUnitCost;
    while (i < T && (2 * done + w) * T >= 2 * i * total) bounds[i++] = u;  // u's middle is past i / T of the work
    done += w;
  }
  return bounds;
}

// q (B, H, D); k_cache, v_cache (NB, BS, KVH, D) with unit stride on D; block_tables (B, max_blocks) int32;
// seq_lens (B,) int32 -> (B, H, D)
at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  for (const at::Tensor* t : {&q_in, &k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat, "q and the caches must be CPU float32");
  }
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q must be (B, H, D) and both caches (num_blocks, block_size, KVH, D)");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches need unit stride on head_dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "block_tables and seq_lens must be int32");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the caches differ");
  TORCH_CHECK(H % KVH == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.numel() == B, "block_tables (B, max_blocks), seq_lens (B,)");
  const int64_t G = H / KVH, max_blocks = tables.size(1);
  const int32_t* table_p = tables.const_data_ptr<int32_t>();
  const int32_t* lens_p = lens.const_data_ptr<int32_t>();
  // Checked here, once, so the parallel loop below cannot read outside the caches.
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens_p[b];
    TORCH_CHECK(L >= 1 && L <= max_blocks * BS, "seq_lens[", b, "] = ", L, " is outside [1, ", max_blocks * BS, "]");
    llm_cpu::check_block_table(table_p, max_blocks, b, L, BS, NB);
  }
  at::Tensor out = at::empty_like(q);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k_cache.const_data_ptr<float>();
  const float* vp = v_cache.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  const int64_t k_sb = k_cache.stride(0), k_so = k_cache.stride(1), k_sh = k_cache.stride(2);
  const int64_t v_sb = v_cache.stride(0), v_so = v_cache.stride(1), v_sh = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  const llm_cpu::PagedArgs args{qp, kp, vp, op, table_p, lens_p, max_blocks, H, KVH, D, BS,
                                 k_sb, k_so, k_sh, v_sb, v_so, v_sh, fscale};

  if (llm_cpu::ops::avx512_on() && avx512_path_takes(G, D)) {
    const int64_t T = std::min<int64_t>(at::get_num_threads(), B * KVH);
    const std::vector<int64_t> bounds = balanced_ranges(lens_p, B, KVH, T);
    const int64_t max_len = *std::max_element(lens_p, lens_p + B);
    at::parallel_for(0, T, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(G * ((max_len + 15) / 16 * 16));
      for (int64_t i = begin; i < end; ++i) llm_cpu::decode_units_avx512(args, bounds[i], bounds[i + 1], scores.data());
    });
    return out;
  }

  // One task per sequence, all its heads together: each cached token's K (then V) rows of every KV
  // head are read at once, in memory order, instead of one head's slice per pass over the context.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens_p[b];
      const int32_t* table = table_p + b * max_blocks;
      const float* qb = qp + b * H * D;  // (H, D): query heads h * G .. h * G + G - 1 use KV head h
      scores.assign(H * L, 0.f);          // (H, L)
      float* o = op + b * H * D;  // (H, D)
      if (D % 32 == 0 && G <= 4) {
        switch (G) {
          case 1: attend_grouped<1>(args, table, L, KVH, D, fscale, qb, scores.data(), o); break;
          case 2: attend_grouped<2>(args, table, L, KVH, D, fscale, qb, scores.data(), o); break;
          case 3: attend_grouped<3>(args, table, L, KVH, D, fscale, qb, scores.data(), o); break;
          default: attend_grouped<4>(args, table, L, KVH, D, fscale, qb, scores.data(), o); break;
        }
        continue;
      }
      // Positions walk block by block (a division per token costs more than its dot products); within a
      // block (in L1), each query head takes 8 positions at a time.
      const __m256 vscale = _mm256_set1_ps(fscale);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const float* kblock = kp + table[t0 / BS] * k_sb;
        const int64_t n = std::min(L - t0, BS);
        for (int64_t i = 0; i < H; ++i) {
          const float* qi = qb + i * D;
          const float* k = kblock + (i / G) * k_sh;
          float* s = scores.data() + i * L + t0;
          int64_t t = 0;
          if (D % 8 == 0) {
            for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(dot8(qi, k + t * k_so, k_so, D), vscale));
          }
          for (; t < n; ++t) s[t] = dot(qi, k + t * k_so, D) * fscale;
        }
      }
      for (int64_t i = 0; i < H; ++i) softmax(scores.data() + i * L, L);
      if (D % 64 == 0) {
        // Each head's output 64 dims at a time in 8 registers over all positions: no store and reload
        // of the output per position.
        for (int64_t i = 0; i < H; ++i) {
          const float* s = scores.data() + i * L;
          const int64_t h_off = (i / G) * v_sh;
          for (int64_t d0 = 0; d0 < D; d0 += 64) {
            __m256 acc[8];
            for (auto& a : acc) a = _mm256_setzero_ps();
            for (int64_t t0 = 0; t0 < L; t0 += BS) {
              const float* vblock = vp + table[t0 / BS] * v_sb + h_off + d0;
              for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
                const float* v = vblock + (t - t0) * v_so;
                const __m256 a = _mm256_set1_ps(s[t]);
                for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(v + 8 * j), acc[j]);
              }
            }
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o + i * D + d0 + 8 * j, acc[j]);
          }
        }
        continue;
      }
      std::fill(o, o + H * D, 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const float* vblock = vp + table[t0 / BS] * v_sb;
        for (int64_t t = t0; t < std::min(L, t0 + BS); ++t) {
          const float* v = vblock + (t - t0) * v_so;
          for (int64_t h = 0; h < KVH; ++h) {
            for (int64_t g = 0; g < G; ++g) axpy(scores[(h * G + g) * L + t], v + h * v_sh, o + (h * G + g) * D, D);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

at::Tensor llm_cpu::ops::paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  return ::paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale);
}

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("paged_decode", paged_decode); }
