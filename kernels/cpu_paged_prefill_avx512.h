// The AVX-512 prefill-attention path of llm_cpu::paged_prefill (cpu_paged_prefill.cpp calls it;
// cpu_paged_prefill_avx512.cpp implements it). Plain data only: the implementing file is compiled for
// AVX-512 and includes nothing but the intrinsics and plain headers (see cpu_linear_tiles.h why).
#pragma once

#include <cstdint>

namespace llm_cpu {

// One paged_prefill call's operands; strides in floats. Caches (NB, BS, KVH, D), unit stride on D.
struct PrefillArgs {
  const float* q;          // (T, H, D)
  const float* k;          // key cache
  const float* v;          // value cache
  float* o;                // (T, H, D)
  const int32_t* tables;   // (B, max_blocks)
  const int32_t* qsl;      // query_start_loc (B + 1,)
  const int32_t* lens;     // seq_lens (B,)
  int64_t max_blocks, H, KVH, D, BS;
  int64_t k_sb, k_so, k_sh, v_sb, v_so, v_sh;
  float scale;
};

// Query rows per tile of the AVX-512 path: a task's row range is best a multiple of it.
constexpr int64_t kPrefillTileRows = 32;

// Whether prefill_rows_avx512 takes head dimension D (32, 64 or 128); the caller checks.
inline bool prefill_avx512_takes(int64_t D) { return D == 32 || D == 64 || D == 128; }

// Floats of scratch prefill_rows_avx512 needs for a task whose rows see up to `positions` positions.
inline int64_t prefill_scratch_floats_avx512(int64_t D, int64_t positions) {
  const int64_t padded = (positions + 15) / 16 * 16;
  return 2 * padded * D + 2 * kPrefillTileRows * D + 16 * kPrefillTileRows;
}

// Sequence b's KV head h: rows r in [r_begin, r_end) of its (query position i, head of the group g) rows,
// r = i * G + g, attend causally to the cached prefix and the new positions up to their own.
void prefill_rows_avx512(const PrefillArgs& a, int64_t b, int64_t h, int64_t r_begin, int64_t r_end, float* scratch);

}  // namespace llm_cpu
