// The tiles of llm_cpu::linear (cpu_linear.cpp), written once for any vector width: cpu_linear.cpp
// compiles them for AVX2 and cpu_linear_avx512.cpp for AVX-512.
//
// The weight is packed in panels of 32 output columns: panel p holds W[32p .. 32p + 31, k] for every k as
// K groups of 32 floats, those of even k first, then those of odd k ((P, K, 32), the last panel
// zero-padded; pack_linear_weight and kHalves below). A tile
// multiplies MB x rows by a panel the outer-product way: per k, the panel's 32 weights are 2 (AVX-512)
// or 4 (AVX2) vector loads, each x element one broadcast, and MB x 32 sums stay in registers, one
// output column per lane. No horizontal sums at the end (the row-major "dot" tiles this replaced spent
// much of their time there and reached a far lower share of the FMA peak; figures in docs/kernels.md),
// and the weights are read as two sequential streams per panel.
//
// Every output element is one chain of FMAs over k = 0, 1, ..., K - 1, then + bias, then + residual,
// whatever the tile, the batch, the thread split or the instruction set: a row's result never depends on
// what else is in the batch, and AVX2 and AVX-512 give the same bits.
//
// Everything here is in an anonymous namespace and nothing includes ATen: the two translation units are
// compiled for different instruction sets, so no inline function may be shared between them (the linker
// would keep one copy, perhaps the AVX-512 one, for both).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace llm_cpu {

constexpr int64_t kPanel = 32;  // output columns per weight panel

// A panel's K rows of 32 weights are stored in two halves, even k then odd k, so that the tiles' walk
// k = 0, 1, 2, ... (the summation order, unchanged) reads two sequential streams (K/2 rows apart) instead
// of one: the hardware prefetchers keep two streams fuller, which helps the 4-12-row tiles most and
// no row count less (figures in docs/kernels.md). Four quarters were no better than two.
constexpr int64_t kHalves = 2;

// Q4 panels (pack_q4_weight in kernels/cpu_kernels.py): a weight whose every run of 32 k of one output
// column is d * q + m exactly (fp32 d and m, q in 0..15: what a Q4_1 GGUF dequantizes to), stored as
// (ceil(N / 32), K / 32, kQ4BlockBytes) bytes: per panel and block of 32 k, the 32 columns' d, their m,
// then for each of the 32 k 16 bytes whose byte i holds column i's q (low nibble) and column i + 16's (high).
constexpr int64_t kQ4Block = 32;  // k per block
constexpr int64_t kQ4BlockBytes = 2 * kPanel * 4 + kQ4Block * kPanel / 2;  // 768
// Q8 panels (pack_q8_weight): a weight that is d * q exactly (fp32 d, q in -127..127: what a Q8_0 GGUF
// dequantizes to), (ceil(N / 32), K / 32, kQ8BlockBytes) bytes: per panel and block of 32 k the 32
// columns' d, then for each k the 32 columns' q (int8), in column order.
constexpr int64_t kQ8BlockBytes = kPanel * 4 + kQ4Block * kPanel;  // 1152

// One call's operands, plain data so that both translation units can take it.
struct LinearArgs {
  const float* P;         // (ceil(N / 32), K, 32) packed weight (or Q4 / Q8 panels, as bytes)
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
  static constexpr int accumulators = 12;  // of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  // The 32 int8 q of one k of a Q8 block as floats, columns 0-7, 8-15, 16-23, 24-31.
  static void int8s(const uint8_t* p, V* q) {
    for (int v = 0; v < 4; ++v)
      q[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * v))));
  }
  // The 32 q of one k of a Q4 block (16 bytes) as floats, columns 0-7, 8-15, 16-23, 24-31.
  static void nibbles(const uint8_t* p, V* q) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i lo = _mm256_cvtepu8_epi32(b), hi = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i mask = _mm256_set1_epi32(15);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo, mask));
    q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask));
    q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4));
    q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4));
  }
};

#ifdef LLM_CPU_AVX512
struct Avx512 {
  using V = __m512;
  static constexpr int width = 16;
  static constexpr int accumulators = 24;  // of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void int8s(const uint8_t* p, V* q) {  // as Avx2::int8s: columns 0-15, 16-31
    for (int v = 0; v < 2; ++v)
      q[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * v))));
  }
  static void nibbles(const uint8_t* p, V* q) {  // as Avx2::nibbles: columns 0-15, 16-31
    const __m512i all = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q[0] = _mm512_cvtepi32_ps(_mm512_and_si512(all, _mm512_set1_epi32(15)));
    q[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(all, 4));
  }
};
#endif

// How far ahead of its loads a tile prefetches each of its panels (the next panel's start included): with
// 2+ rows a k step is enough arithmetic that the hardware prefetcher alone leaves the stream idle between
// misses. 4 KB was as good as any distance tried, at 12 rows and at one (docs/kernels.md).
constexpr int64_t kPrefetchFloats = 1024;

// y[m0 + i, 32 p .. 32 p + 31] for i < MB, from the accumulators of one panel.
template <class Vec>
void store_panel(const LinearArgs& a, const typename Vec::V* acc, int64_t m, int64_t p) {
  constexpr int VP = kPanel / Vec::width;
  const int64_t col = p * kPanel;
  float* y = a.Y + m * a.N + col;
  if (col + kPanel <= a.N) {
    for (int v = 0; v < VP; ++v) {
      typename Vec::V s = acc[v];
      if (a.bias) s = Vec::add(s, Vec::load(a.bias + col + v * Vec::width));
      if (a.residual) s = Vec::add(s, Vec::load(a.residual + m * a.N + col + v * Vec::width));
      Vec::store(y + v * Vec::width, s);
    }
    return;
  }
  float sums[kPanel];  // the zero-padded last panel: the same additions, one column at a time
  for (int v = 0; v < VP; ++v) Vec::store(sums + v * Vec::width, acc[v]);
  for (int64_t c = 0; c < a.N - col; ++c) {
    float s = sums[c];
    if (a.bias) s += a.bias[col + c];
    if (a.residual) s += a.residual[m * a.N + col + c];
    y[c] = s;
  }
}

// x rows [m0, m0 + MB) times the NP panels p, p + S, ..., p + (NP - 1) S.
template <class Vec, int MB, int NP>
void tile(const LinearArgs& a, int64_t m0, int64_t p, int64_t S) {
  using V = typename Vec::V;
  constexpr int VP = kPanel / Vec::width;
  const int64_t K = a.K;
  const float* w[NP];
  for (int j = 0; j < NP; ++j) w[j] = a.P + (p + j * S) * K * kPanel;
  const float* x = a.X + m0 * K;
  V acc[MB][NP][VP];
  for (auto& row : acc)
    for (auto& panel : row)
      for (auto& v : panel) v = Vec::zero();
  // Step k reads slab row `row` (see kHalves): k = 2 kk from the even half, k = 2 kk + 1 from the odd one.
  auto step = [&](int64_t k, int64_t row) __attribute__((always_inline)) {
    const int64_t off = row * kPanel;
    for (int j = 0; j < NP; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + off + kPrefetchFloats), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + off + kPrefetchFloats + 16), _MM_HINT_T0);
    }
    V wv[NP][VP];
    for (int j = 0; j < NP; ++j)
      for (int v = 0; v < VP; ++v) wv[j][v] = Vec::load(w[j] + off + v * Vec::width);
    for (int i = 0; i < MB; ++i) {
      const V xb = Vec::broadcast(x + i * K + k);
      for (int j = 0; j < NP; ++j)
        for (int v = 0; v < VP; ++v) acc[i][j][v] = Vec::fma(wv[j][v], xb, acc[i][j][v]);
    }
  };
  const int64_t odd_start = (K + 1) / 2;
  for (int64_t kk = 0; kk < K / 2; ++kk) {
    step(2 * kk, kk);
    step(2 * kk + 1, odd_start + kk);
  }
  if (K % 2) step(K - 1, K / 2);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j) store_panel<Vec>(a, acc[i][j], m0 + i, p + j * S);
}

// The most x rows one tile takes: its accumulators (12 x 2 vectors AVX-512, 3 x 4 AVX2).
template <class Vec>
constexpr int max_rows = Vec::accumulators / (kPanel / Vec::width);

// Panels a tile of R rows takes at once: as many as its accumulators allow, at most 4 (8 streams with
// kHalves). Several panels far apart are several sequential reads in flight, which beat one panel at
// every row count measured; one row takes 4 (8 panels read no faster with two streams per panel).
// Figures: docs/kernels.md.
template <class Vec, int R>
constexpr int panels_at_once() {
  constexpr int n = max_rows<Vec> / R, cap = 4;
  return n < 1 ? 1 : n > cap ? cap : n;
}

// R x rows times panels [p0, p1), NP at once S panels apart (panel p0 + i + j S); the panels left over
// NP / 2 at once, and so on down to 1 (SmolLM2's qkv gives a thread 15 panels: 3 x 4, then 2, then 1
// at once, not 12 and then 3 single panels).
template <class Vec, int R, int NP>
void panels_by_streams(const LinearArgs& a, int64_t p0, int64_t p1) {
  const int64_t S = (p1 - p0) / NP;
  for (int64_t i = 0; i < S; ++i) tile<Vec, R, NP>(a, 0, p0 + i, S);
  if constexpr (NP > 1) {
    panels_by_streams<Vec, R, NP / 2>(a, p0 + NP * S, p1);
  } else {
    (void)S;
  }
}

// One pass: all M (<= max_rows) x rows times the thread's panels [p0, p1), as many at once as the
// tile's registers allow.
template <class Vec, int R = max_rows<Vec>>
void one_pass(const LinearArgs& a, int64_t p0, int64_t p1) {
  if constexpr (R >= 1) {
    if (a.M != R) {
      one_pass<Vec, R - 1>(a, p0, p1);
      return;
    }
    panels_by_streams<Vec, R, panels_at_once<Vec, R>()>(a, p0, p1);
  }
}

// R x rows from m on (1 <= R <= max_rows) times panel p.
template <class Vec, int R = max_rows<Vec>>
void rows_times_panel(const LinearArgs& a, int64_t m, int64_t R_rows, int64_t p) {
  if constexpr (R >= 1) {
    if (R_rows == R) {
      tile<Vec, R, 1>(a, m, p, 0);
    } else {
      rows_times_panel<Vec, R - 1>(a, m, R_rows, p);
    }
  }
}

// Passes per block of x rows in `panels`: each panel goes through one block's rows (36 with SmolLM2's
// shapes: 83-220 KB of x, in L2) before the next panel, and the next block starts over the panels.
// Faster than all rows per panel at both short and long prefills (2-3 passes alike; 6+ slower).
constexpr int64_t kBlockPasses = 3;

// One thread's panels [p0, p1). Up to max_rows x rows: one pass (one_pass). More: each panel times a
// block of x rows, in passes of equal size (13 rows: 7 + 6, not 12 + 1); the panel (73-196 KB for
// SmolLM2) comes from memory once per block, then from L2.
template <class Vec>
void panels(const LinearArgs& a, int64_t p0, int64_t p1) {
  if (a.M <= max_rows<Vec>) {
    one_pass<Vec>(a, p0, p1);
    return;
  }
  const int64_t passes = (a.M + max_rows<Vec> - 1) / max_rows<Vec>;
  const int64_t rows = (a.M + passes - 1) / passes;
  const int64_t block = rows * kBlockPasses;
  for (int64_t m0 = 0; m0 < a.M; m0 += block) {
    const int64_t m1 = m0 + block < a.M ? m0 + block : a.M;
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t m = m0; m < m1; m += rows) rows_times_panel<Vec>(a, m, m1 - m < rows ? m1 - m : rows, p);
    }
  }
}

// The two quantized packings: where a block's q sit and how they become the weights' own bits.
struct Q4Format {  // w = fma(d, q, m): d * q is exact in fp32, so this is the one rounding of d * q + m
  static constexpr int64_t block_bytes = kQ4BlockBytes, q_offset = 2 * kPanel * 4, k_bytes = kPanel / 2;
  static constexpr bool has_min = true;
  template <class Vec>
  static void q(const uint8_t* p, typename Vec::V* out) { Vec::nibbles(p, out); }
};
struct Q8Format {  // w = d * q, exact in fp32
  static constexpr int64_t block_bytes = kQ8BlockBytes, q_offset = kPanel * 4, k_bytes = kPanel;
  static constexpr bool has_min = false;
  template <class Vec>
  static void q(const uint8_t* p, typename Vec::V* out) { Vec::int8s(p, out); }
};

// x rows [m0, m0 + MB) times the NP quantized panels p, p + S, ...: each block's q become the weights in
// registers (Format), and then the same FMA chain over k = 0, 1, ... as `tile`, so the results are the
// fp32 panels' bits.
template <class Vec, class Format, int MB, int NP>
void tile_quant(const LinearArgs& a, int64_t m0, int64_t p, int64_t S) {
  using V = typename Vec::V;
  constexpr int VP = kPanel / Vec::width;
  const int64_t K = a.K, blocks = K / kQ4Block;
  const uint8_t* base[NP];
  for (int j = 0; j < NP; ++j)
    base[j] = reinterpret_cast<const uint8_t*>(a.P) + (p + j * S) * blocks * Format::block_bytes;
  const float* x = a.X + m0 * K;
  V acc[MB][NP][VP];
  for (auto& row : acc)
    for (auto& panel : row)
      for (auto& v : panel) v = Vec::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    V d[NP][VP], m[NP][VP];
    const uint8_t* q[NP];
    for (int j = 0; j < NP; ++j) {
      const uint8_t* block = base[j] + b * Format::block_bytes;
      for (int64_t ahead = 2 * Format::block_bytes; ahead < 3 * Format::block_bytes; ahead += 64)
        _mm_prefetch(reinterpret_cast<const char*>(block + ahead), _MM_HINT_T0);
      const float* scales = reinterpret_cast<const float*>(block);
      for (int v = 0; v < VP; ++v) {
        d[j][v] = Vec::load(scales + v * Vec::width);
        if constexpr (Format::has_min) m[j][v] = Vec::load(scales + kPanel + v * Vec::width);
      }
      q[j] = block + Format::q_offset;
    }
    const float* xk = x + b * kQ4Block;
    for (int64_t kk = 0; kk < kQ4Block; ++kk) {
      V w[NP][VP];
      for (int j = 0; j < NP; ++j) {
        Format::template q<Vec>(q[j] + kk * Format::k_bytes, w[j]);
        for (int v = 0; v < VP; ++v) {
          if constexpr (Format::has_min) {
            w[j][v] = Vec::fma(d[j][v], w[j][v], m[j][v]);
          } else {
            w[j][v] = Vec::mul(d[j][v], w[j][v]);
          }
        }
      }
      for (int i = 0; i < MB; ++i) {
        const V xb = Vec::broadcast(xk + i * K + kk);
        for (int j = 0; j < NP; ++j)
          for (int v = 0; v < VP; ++v) acc[i][j][v] = Vec::fma(w[j][v], xb, acc[i][j][v]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NP; ++j) store_panel<Vec>(a, acc[i][j], m0 + i, p + j * S);
}

// Quantized panels [p0, p1), R rows from m0; NP panels at once S apart, the rest NP / 2 at once
// (as panels_by_streams).
template <class Vec, class Format, int R, int NP>
void quant_panels_by_streams(const LinearArgs& a, int64_t m0, int64_t p0, int64_t p1) {
  const int64_t S = (p1 - p0) / NP;
  for (int64_t i = 0; i < S; ++i) tile_quant<Vec, Format, R, NP>(a, m0, p0 + i, S);
  if constexpr (NP > 1) quant_panels_by_streams<Vec, Format, R, NP / 2>(a, m0, p0 + NP * S, p1);
}

// R_rows (<= max_rows) x rows from m0 times quantized panels [p0, p1).
template <class Vec, class Format, int R = max_rows<Vec>>
void quant_rows(const LinearArgs& a, int64_t m0, int64_t R_rows, int64_t p0, int64_t p1) {
  if constexpr (R >= 1) {
    if (R_rows != R) {
      quant_rows<Vec, Format, R - 1>(a, m0, R_rows, p0, p1);
      return;
    }
    quant_panels_by_streams<Vec, Format, R, (R <= 2 ? 2 : 1)>(a, m0, p0, p1);
  }
}

// One thread's quantized panels [p0, p1): the x rows in passes of equal size, at most max_rows each.
template <class Vec, class Format>
void quant_panels(const LinearArgs& a, int64_t p0, int64_t p1) {
  const int64_t passes = (a.M + max_rows<Vec> - 1) / max_rows<Vec>;
  const int64_t rows = (a.M + passes - 1) / passes;
  for (int64_t m0 = 0; m0 < a.M; m0 += rows)
    quant_rows<Vec, Format>(a, m0, a.M - m0 < rows ? a.M - m0 : rows, p0, p1);
}

}  // namespace
}  // namespace llm_cpu
