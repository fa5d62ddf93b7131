// The operands of one paged-attention call (llm_cpu::paged_decode, llm_cpu::paged_prefill) as plain
// data, for the code compiled for AVX-512 (which includes no torch header) and the AVX2 code alike.
#pragma once

#include <cstdint>

namespace llm_cpu {

// Strides in floats. Caches (NB, BS, KVH, D), unit stride on D.
struct PagedArgs {
  const float* q;          // decode (B, H, D); prefill (T, H, D)
  const float* k;          // key cache
  const float* v;          // value cache
  float* o;                // q's shape
  const int32_t* tables;   // (B, max_blocks)
  const int32_t* lens;     // (B,): positions each sequence sees (seq_lens)
  int64_t max_blocks, H, KVH, D, BS;
  int64_t k_sb, k_so, k_sh, v_sb, v_so, v_sh;
  float scale;
  const int32_t* qsl = nullptr;  // prefill only: query_start_loc (B + 1,)
};

}  // namespace llm_cpu
