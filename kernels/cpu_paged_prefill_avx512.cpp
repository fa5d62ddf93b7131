// llm_cpu::paged_prefill's AVX-512 path (cpu_paged_prefill.cpp calls it where the CPU has AVX-512).
// Compiled for AVX-512 by the pragma below; it includes nothing but the intrinsics and plain headers, and
// uses no std templates (see cpu_linear_tiles.h why).
//
// Flash-attention style, with the query rows across the vector lanes. A task is one sequence's KV head h
// and a range of its rows (query position i, query head h * G + g). It first copies the K and V rows of
// head h it can need into two contiguous (positions, D) buffers; then per tile of 16 rows:
//   - the 16 queries, scaled, transposed into Qt (D, 16): lane r of Qt[d] is row r's element d;
//   - per block of 16 positions: 16 score vectors s[t] (lane r: row r . K[t]), each built by D FMAs of
//     Qt[d] with K[t][d] broadcast; the causal mask; then the online softmax, all vertical (lane r is row
//     r's max, sum and rescale factor: no horizontal reductions); then O (16 x D, in L1) = O * alpha +
//     P V, a few rows' D / 16 accumulators at a time, P broadcast from memory;
//   - O / sum goes to the output.
// Each row's arithmetic depends only on its own query and the positions it sees, in blocks that start at
// multiples of 16 from position 0: the result of a row is the same whatever the tiling, the chunking of
// the prompt or the threads. Why not the AVX2 kernel's two-pass exact softmax (3 rows at a time against
// K transposed for the whole context): it read all of K from L2 for every 3 rows and ran at 21-36 GFLOP/s
// for 512 rows after a 0-8k prefix; figures in docs/kernels.md.
#pragma GCC target("avx2,fma,avx512f")

#include <immintrin.h>

#include <cstdint>

#include "cpu_paged_prefill_avx512.h"
#include "cpu_simd_avx512.h"

namespace llm_cpu {
namespace {

constexpr int kVecs = 2;           // vectors of query rows per tile
constexpr int kRows = 16 * kVecs;  // query rows per tile: one lane each
constexpr int kPos = 16;           // positions per key block
static_assert(kRows == kPrefillTileRows, "the header's tile size");

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// dst (padded, D) = rows [0, n) of one head of a paged cache, zeros in [n, padded).
template <int D>
void gather_rows(const float* head, const int32_t* table, int64_t BS, int64_t sb, int64_t so, int64_t n,
                 int64_t padded, float* dst) {
  for (int64_t t0 = 0; t0 < n; t0 += BS) {  // block by block: no division per row
    const float* block = head + table[t0 / BS] * sb;
    for (int64_t t = t0; t < min64(n, t0 + BS); ++t) {
      const float* src = block + (t - t0) * so;
      for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + t * D + 16 * c, _mm512_loadu_ps(src + 16 * c));
    }
  }
  for (int64_t t = n; t < padded; ++t)
    for (int c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + t * D + 16 * c, _mm512_setzero_ps());
}

// One tile: rows q[r] (r < kRows; o[r] null for a row past the task's end, which repeats the last one)
// see positions [0, limit[r]) of kc, vc (positions, D). qt (D, kRows), ob (kRows, D), sp (kPos, kRows):
// scratch.
template <int D>
void tile(const float* const* q, float* const* o, const int32_t* limit, const float* kc, const float* vc,
          float scale, float* qt, float* ob, float* sp) {
  constexpr int C = D / 16;
  constexpr int RP = 16 / C;  // rows per output pass: RP x C accumulators
  for (int r = 0; r < kRows; ++r)
    for (int d = 0; d < D; ++d) qt[d * kRows + r] = q[r][d] * scale;
  for (int i = 0; i < kRows * D; i += 16) _mm512_storeu_ps(ob + i, _mm512_setzero_ps());
  const __m512 minus_inf = _mm512_set1_ps(-__builtin_inff());
  const int64_t first_limit = limit[0], seen = limit[kRows - 1];  // rows go in position order
  __m512i lim[kVecs];
  __m512 m[kVecs], l[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    lim[v] = _mm512_loadu_si512(limit + 16 * v);
    m[v] = minus_inf;
    l[v] = _mm512_setzero_ps();
  }
  alignas(64) float alpha[kRows];
  for (int64_t p0 = 0; p0 < seen; p0 += kPos) {
    // Scores, half a block at a time: kVecs x 8 accumulators, kVecs + 8 loads per 8 kVecs FMAs.
    const float* kb = kc + p0 * D;
    for (int half = 0; half < kPos; half += 8) {
      __m512 acc[8][kVecs];
      for (auto& row : acc)
        for (auto& x : row) x = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) {
        __m512 qv[kVecs];
        for (int v = 0; v < kVecs; ++v) qv[v] = _mm512_loadu_ps(qt + d * kRows + 16 * v);
        for (int t = 0; t < 8; ++t) {
          const __m512 kv = _mm512_set1_ps(kb[(half + t) * D + d]);
          for (int v = 0; v < kVecs; ++v) acc[t][v] = _mm512_fmadd_ps(kv, qv[v], acc[t][v]);
        }
      }
      for (int t = 0; t < 8; ++t)
        for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(sp + (half + t) * kRows + 16 * v, acc[t][v]);
    }
    // Online softmax, one vector of rows at a time; the probabilities replace the scores in sp.
    const bool masked = p0 + kPos > first_limit;  // some row does not see the whole block
    for (int v = 0; v < kVecs; ++v) {
      __m512 s[kPos];
      for (int t = 0; t < kPos; ++t) {
        s[t] = _mm512_loadu_ps(sp + t * kRows + 16 * v);
        if (masked) {
          const __mmask16 sees = _mm512_cmpgt_epi32_mask(lim[v], _mm512_set1_epi32(static_cast<int>(p0 + t)));
          s[t] = _mm512_mask_mov_ps(minus_inf, sees, s[t]);
        }
      }
      __m512 block_max = s[0];
      for (int t = 1; t < kPos; ++t) block_max = _mm512_max_ps(block_max, s[t]);
      const __m512 m_new = _mm512_max_ps(m[v], block_max);  // finite: every row sees position 0
      const __m512 rescale = exp16(_mm512_sub_ps(m[v], m_new));  // 0 on the first block (m = -inf)
      __m512 sum = _mm512_setzero_ps();
      for (int t = 0; t < kPos; ++t) {
        const __m512 e = exp16(_mm512_sub_ps(s[t], m_new));  // 0 where masked
        _mm512_storeu_ps(sp + t * kRows + 16 * v, e);
        sum = _mm512_add_ps(sum, e);
      }
      l[v] = _mm512_fmadd_ps(l[v], rescale, sum);
      m[v] = m_new;
      _mm512_store_ps(alpha + 16 * v, rescale);
    }
    // O = O * alpha + P V, RP rows at a time.
    const int64_t n = min64(kPos, seen - p0);  // positions of the block any row sees
    const float* vb = vc + p0 * D;
    for (int r0 = 0; r0 < kRows; r0 += RP) {
      __m512 acc[RP][C];
      for (int r = 0; r < RP; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(ob + (r0 + r) * D + 16 * c), a);
      }
      for (int64_t t = 0; t < n; ++t) {
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vb + t * D + 16 * c);
        for (int r = 0; r < RP; ++r) {
          const __m512 pr = _mm512_set1_ps(sp[t * kRows + r0 + r]);
          for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
        }
      }
      for (int r = 0; r < RP; ++r)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(ob + (r0 + r) * D + 16 * c, acc[r][c]);
    }
  }
  alignas(64) float sums[kRows];
  for (int v = 0; v < kVecs; ++v) _mm512_store_ps(sums + 16 * v, l[v]);
  for (int r = 0; r < kRows; ++r) {
    if (o[r] == nullptr) continue;
    const __m512 inv = _mm512_set1_ps(1.f / sums[r]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o[r] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ob + r * D + 16 * c), inv));
  }
}

template <int D>
void rows(const PagedArgs& a, int64_t b, int64_t h, int64_t r_begin, int64_t r_end, float* scratch) {
  const int64_t G = a.H / a.KVH, lo = a.qsl[b], q_len = a.qsl[b + 1] - lo, L = a.lens[b], first = L - q_len;
  const int32_t* table = a.tables + b * a.max_blocks;
  const int64_t seen_max = first + (r_end - 1) / G + 1;  // positions the task's last row sees
  const int64_t padded = (seen_max + kPos - 1) / kPos * kPos;
  float* kc = scratch;  // layout: prefill_scratch_floats_avx512
  float* vc = kc + padded * D;
  float* qt = vc + padded * D;
  float* ob = qt + kRows * D;
  float* sp = ob + kRows * D;
  gather_rows<D>(a.k + h * a.k_sh, table, a.BS, a.k_sb, a.k_so, seen_max, padded, kc);
  gather_rows<D>(a.v + h * a.v_sh, table, a.BS, a.v_sb, a.v_so, seen_max, padded, vc);
  for (int64_t r0 = r_begin; r0 < r_end; r0 += kRows) {
    const int64_t R = min64(kRows, r_end - r0);
    const float* q[kRows];
    float* o[kRows];
    alignas(64) int32_t limit[kRows];
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = r0 + min64(r, R - 1), i = row / G, g = row % G;
      const int64_t offset = ((lo + i) * a.H + h * G + g) * D;
      q[r] = a.q + offset;
      o[r] = r < R ? a.o + offset : nullptr;
      limit[r] = static_cast<int32_t>(first + i + 1);
    }
    tile<D>(q, o, limit, kc, vc, a.scale, qt, ob, sp);
  }
}

}  // namespace

int64_t prefill_scratch_floats_avx512(int64_t D, int64_t positions) {
  const int64_t padded = (positions + kPos - 1) / kPos * kPos;
  return 2 * padded * D + 2 * kRows * D + kPos * kRows;  // kc, vc; qt, ob; sp (see rows)
}

void prefill_rows_avx512(const PagedArgs& a, int64_t b, int64_t h, int64_t r_begin, int64_t r_end, float* scratch) {
  switch (a.D) {
    case 32: return rows<32>(a, b, h, r_begin, r_end, scratch);
    case 64: return rows<64>(a, b, h, r_begin, r_end, scratch);
    default: return rows<128>(a, b, h, r_begin, r_end, scratch);
  }
}

}  // namespace llm_cpu
