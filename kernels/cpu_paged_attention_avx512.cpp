// llm_cpu::paged_decode's AVX-512 path (cpu_paged_attention.cpp calls it where the CPU has AVX-512).
// Compiled for AVX-512 (as is cpu_linear_avx512.cpp) by the pragma below; it includes nothing but the
// intrinsics and plain headers, and uses no std templates (see cpu_linear_tiles.h why).
//
// A unit is one sequence's KV head h with its G query heads (G * D / 16 + D / 16 vectors fit in
// registers: see cpu_paged_decode_avx512.h). Per unit, three passes over its cached positions:
//   scores: 16 positions x 1 query head at a time, each position's D-dim dot product in one register
//     (D / 16 FMAs), the 16 sums then transposed into one register (30 shuffles, 15 adds) and stored;
//   softmax over the G score rows (max, exp, sum, all 16 wide);
//   output: per position, V's D / 16 vectors times G broadcast weights into G * D / 16 accumulators,
//     scaled by 1 / sum at the end.
// The next block's rows of this head are prefetched on both walks (cold caches, as in a decode step;
// two blocks ahead, or also the walks' first blocks and the next unit's: no faster in a C++ harness).
// The AVX2 path it replaced (cpu_paged_attention.cpp, still used without AVX-512) held 4 positions x G
// heads of 8-wide sums and paid 3 horizontal adds per 4 positions; its output pass went over V twice
// (32 dims at a time). Figures: docs/kernels.md.
#pragma GCC target("avx2,fma,avx512f")

#include <immintrin.h>

#include <cstdint>

#include "cpu_paged_decode_avx512.h"
#include "cpu_simd_avx512.h"

namespace llm_cpu {
namespace {

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Lane t of the result = the sum of a[t]'s 16 lanes. Pairs within 128-bit lanes, then quads, then the
// four 128-bit quarters; the result comes out in natural order.
inline __m512 transpose_sum16(const __m512* a) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per quarter: [a_2i, a_2i+1, a_2i, a_2i+1] partial sums
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per quarter: [a_4i .. a_4i+3], each the sum of that quarter's 4 lanes
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xDD));
}

inline __mmask16 first(int64_t m) { return static_cast<__mmask16>(m >= 16 ? 0xFFFF : (1u << m) - 1); }

// Asks for rows [0, n) of a block, `lines` cache lines each from `row` on (row stride `stride`).
inline void prefetch_block(const float* row, int64_t n, int64_t stride, int lines) {
  for (int64_t t = 0; t < n; ++t)
    for (int l = 0; l < lines; ++l) _mm_prefetch(reinterpret_cast<const char*>(row + t * stride + 16 * l), _MM_HINT_T0);
}

// One unit: sequence b (L positions through `table`), KV head h, query heads h G .. h G + G - 1.
//   q (G, D) -> o (G, D); s: G rows of Lp >= L floats.
template <int G, int C>
void unit(const PagedArgs& a, const int32_t* table, int64_t L, int64_t h, const float* q, float* o, float* s,
          int64_t Lp) {
  constexpr int D = 16 * C;
  const int64_t BS = a.BS, blocks = (L + BS - 1) / BS;
  const __m512 scale = _mm512_set1_ps(a.scale);
  // Scores.
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t t0 = j * BS, n = min64(BS, L - t0);
    const float* kb = a.k + table[j] * a.k_sb + h * a.k_sh;
    if (j + 1 < blocks) prefetch_block(a.k + table[j + 1] * a.k_sb + h * a.k_sh, min64(BS, L - t0 - BS), a.k_so, C);
    for (int64_t t1 = 0; t1 < n; t1 += 16) {
      const int64_t m = min64(16, n - t1);
      for (int g = 0; g < G; ++g) {
        __m512 qv[C], acc[16];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + g * D + 16 * c);
        for (int t = 0; t < 16; ++t) {
          if (t >= m) {
            acc[t] = _mm512_setzero_ps();
            continue;
          }
          const float* kr = kb + (t1 + t) * a.k_so;
          acc[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int c = 1; c < C; ++c) acc[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[t]);
        }
        _mm512_mask_storeu_ps(s + g * Lp + t0 + t1, first(m), _mm512_mul_ps(transpose_sum16(acc), scale));
      }
    }
  }
  // Softmax numerators in place; 1 / sum kept for the output.
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* row = s + g * Lp;
    __m512 vmax = _mm512_set1_ps(-__builtin_inff());
    for (int64_t t = 0; t < L; t += 16) vmax = _mm512_mask_max_ps(vmax, first(L - t), vmax, _mm512_loadu_ps(row + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 16) {
      const __mmask16 k = first(L - t);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), mx)));
      _mm512_mask_storeu_ps(row + t, k, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    inv_sum[g] = 1.f / _mm512_reduce_add_ps(vsum);
  }
  // Output.
  __m512 acc[G][C];
  for (auto& head : acc)
    for (auto& x : head) x = _mm512_setzero_ps();
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t t0 = j * BS, n = min64(BS, L - t0);
    const float* vb = a.v + table[j] * a.v_sb + h * a.v_sh;
    if (j + 1 < blocks) prefetch_block(a.v + table[j + 1] * a.v_sb + h * a.v_sh, min64(BS, L - t0 - BS), a.v_so, C);
    for (int64_t t = 0; t < n; ++t) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vb + t * a.v_so + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g * Lp + t0 + t]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + g * D + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
}

template <int G, int C>
void units(const PagedArgs& a, int64_t u0, int64_t u1, float* scratch) {
  constexpr int D = 16 * C;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t b = u / a.KVH, h = u % a.KVH, L = a.lens[b];
    const int64_t off = b * a.H * D + h * G * D;  // query heads h G .. h G + G - 1 of sequence b
    unit<G, C>(a, a.tables + b * a.max_blocks, L, h, a.q + off, a.o + off, scratch, (L + 15) / 16 * 16);
  }
}

}  // namespace

void decode_units_avx512(const PagedArgs& a, int64_t u0, int64_t u1, float* scratch) {
  const int64_t G = a.H / a.KVH;
  switch (a.D) {
    case 32:
      switch (G) {
        case 1: return units<1, 2>(a, u0, u1, scratch);
        case 2: return units<2, 2>(a, u0, u1, scratch);
        case 3: return units<3, 2>(a, u0, u1, scratch);
        case 4: return units<4, 2>(a, u0, u1, scratch);
        case 5: return units<5, 2>(a, u0, u1, scratch);
        case 6: return units<6, 2>(a, u0, u1, scratch);
        case 7: return units<7, 2>(a, u0, u1, scratch);
        default: return units<8, 2>(a, u0, u1, scratch);
      }
    case 64:
      switch (G) {
        case 1: return units<1, 4>(a, u0, u1, scratch);
        case 2: return units<2, 4>(a, u0, u1, scratch);
        case 3: return units<3, 4>(a, u0, u1, scratch);
        default: return units<4, 4>(a, u0, u1, scratch);
      }
    default:
      switch (G) {
        case 1: return units<1, 8>(a, u0, u1, scratch);
        default: return units<2, 8>(a, u0, u1, scratch);
      }
  }
}

}  // namespace llm_cpu
