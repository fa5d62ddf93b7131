// The tiles of llm_cpu::linear (cpu_linear.cpp), written once for any vector width: cpu_linear.cpp
// compiles them for AVX2 and cpu_linear_avx512.cpp for AVX-512 (the 16-float vectors double the
// arithmetic per instruction, which counts from ~8 rows up).
//
// Everything here is in an anonymous namespace and nothing includes ATen: the two translation units are
// compiled for different instruction sets, so no inline function may be shared between them (the linker
// would keep one copy, perhaps the AVX-512 one, for both).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace llm_cpu {

// One call's operands, plain data so that both translation units can take it.
struct LinearArgs {
  const float* W;         // (N, K) row-major
  const float* X;         // (M, K) row-major
  const float* bias;      // (N,) or null
  const float* residual;  // (M, N) or null
  float* Y;               // (M, N)
  int64_t M, N, K;
};

namespace {

struct Avx2 {
  using V = __m256;
  static constexpr int width = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // The sum of a vector's 8 floats, added in the same order as sum4 adds each of its vectors, so that a
  // dot product comes out the same in whichever tile it was computed.
  static float sum(V v) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_hadd_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  // The sums of 4 vectors together (3 hadds), not one horizontal sum each.
  static void sum4(V a, V b, V c, V d, float* out) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
};

#ifdef LLM_CPU_AVX512
struct Avx512 {
  using V = __m512;
  static constexpr int width = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 halves(V v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static float sum(V v) { return Avx2::sum(halves(v)); }
  static void sum4(V a, V b, V c, V d, float* out) { Avx2::sum4(halves(a), halves(b), halves(c), halves(d), out); }
};
#endif

inline float epilogue(const LinearArgs& p, float s, int64_t m, int64_t n) {
  if (p.bias) s += p.bias[n];
  if (p.residual) s += p.residual[m * p.N + n];
  return s;
}

// x rows [m0, m0 + MB) times the NB weight rows n, n + S, ..., n + (NB - 1) S: MB * NB accumulators,
// each loaded vector used NB (x) or MB (weight) times.
template <class Vec, int MB, int NB>
void tile(const LinearArgs& p, int64_t m0, int64_t n, int64_t S) {
  using V = typename Vec::V;
  constexpr int W = Vec::width;
  const int64_t K = p.K;
  const float* w_rows[NB];
  for (int j = 0; j < NB; ++j) w_rows[j] = p.W + (n + j * S) * K;
  V acc[MB][NB];
  for (auto& row : acc)
    for (auto& a : row) a = Vec::zero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    V w[NB];
    for (int j = 0; j < NB; ++j) w[j] = Vec::load(w_rows[j] + k);
    for (int i = 0; i < MB; ++i) {
      const V x = Vec::load(p.X + (m0 + i) * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = Vec::fma(w[j], x, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    float sums[NB];
    if constexpr (NB % 4 == 0) {
      for (int j = 0; j < NB; j += 4) Vec::sum4(acc[i][j], acc[i][j + 1], acc[i][j + 2], acc[i][j + 3], sums + j);
    } else {
      for (int j = 0; j < NB; ++j) sums[j] = Vec::sum(acc[i][j]);
    }
    for (int j = 0; j < NB; ++j) {
      float s = sums[j];
      for (int64_t t = k; t < K; ++t) s += w_rows[j][t] * p.X[(m0 + i) * K + t];
      p.Y[(m0 + i) * p.N + n + j * S] = epilogue(p, s, m0 + i, n + j * S);
    }
  }
}

// The R (< MB) x rows from m on, in one tile of R rows.
template <class Vec, int R, int NB>
void last_x_rows(const LinearArgs& p, int64_t m, int64_t n, int64_t S) {
  if constexpr (R > 0) {
    if (p.M - m == R) {
      tile<Vec, R, NB>(p, m, n, S);
    } else {
      last_x_rows<Vec, R - 1, NB>(p, m, n, S);
    }
  }
}

// All x rows, MB at a time, times the weight rows n, n + S, ..., n + (NB - 1) S.
template <class Vec, int MB, int NB>
void all_x_rows(const LinearArgs& p, int64_t n, int64_t S) {
  int64_t m = 0;
  for (; m + MB <= p.M; m += MB) tile<Vec, MB, NB>(p, m, n, S);
  last_x_rows<Vec, MB - 1, NB>(p, m, n, S);
}

// One thread's weight rows [n0, n1), read as NB streams S rows apart (row i of stream j: n0 + j S + i),
// so that NB sequential reads in distant pages are in flight at once: the weights come from memory
// ~1.5x faster than one stream of adjacent rows (SmolLM2's rows are 2.3-6 KB, so a few adjacent rows
// lie in the same one or two 4 KB pages, which the hardware prefetcher walks one at a time).
template <class Vec, int MB, int NB>
void weight_rows(const LinearArgs& p, int64_t n0, int64_t n1) {
  const int64_t S = (n1 - n0) / NB;
  for (int64_t i = 0; i < S; ++i) all_x_rows<Vec, MB, NB>(p, n0 + i, S);
  for (int64_t n = n0 + NB * S; n < n1; ++n) all_x_rows<Vec, MB, 1>(p, n, 0);
}

}  // namespace
}  // namespace llm_cpu
