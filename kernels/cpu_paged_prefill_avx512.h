// The AVX-512 prefill-attention path of llm_cpu::paged_prefill (cpu_paged_prefill.cpp calls it;
// cpu_paged_prefill_avx512.cpp implements it). Plain data only: the implementing file is compiled for
// AVX-512 and includes nothing but the intrinsics and plain headers (see cpu_linear_tiles.h why).
#pragma once

#include <cstdint>

#include "cpu_paged_args.h"

namespace llm_cpu {

// Query rows per tile of the AVX-512 path: a task's row range is best a multiple of it.
constexpr int64_t kPrefillTileRows = 32;

// Takes head dimension D = 32, 64 or 128 (the caller checks: cpu_paged_prefill.cpp).
// Floats of scratch prefill_rows_avx512 needs for a task whose rows see up to `positions` positions.
// (Defined in the AVX-512 file, like everything here, so only callable where the CPU has AVX-512.)
int64_t prefill_scratch_floats_avx512(int64_t D, int64_t positions);

// Sequence b's KV head h: rows r in [r_begin, r_end) of its (query position i, head of the group g) rows,
// r = i * G + g, attend causally to the cached prefix and the new positions up to their own.
void prefill_rows_avx512(const PagedArgs& a, int64_t b, int64_t h, int64_t r_begin, int64_t r_end, float* scratch);

}  // namespace llm_cpu
