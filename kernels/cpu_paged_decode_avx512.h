// The AVX-512 decode-attention path of llm_cpu::paged_decode (cpu_paged_attention.cpp calls it;
// cpu_paged_attention_avx512.cpp implements it). Plain data only: the implementing file is compiled for
// AVX-512 and includes nothing but the intrinsics and this header (see cpu_linear_tiles.h why).
#pragma once

#include <cstdint>

#include "cpu_paged_args.h"

namespace llm_cpu {

// Takes G query heads per KV head of dimension D = 32 with G <= 8, 64 with G <= 4, or 128 with G <= 2
// (G x D / 16 accumulators and D / 16 V rows in registers); the caller checks (cpu_paged_attention.cpp).
// Units u = b * KVH + h in [u0, u1): query heads h * G .. h * G + G - 1 of sequence b over its lens[b]
// positions. scratch: G * (max lens rounded up to 16) floats.
void decode_units_avx512(const PagedArgs& a, int64_t u0, int64_t u1, float* scratch);

}  // namespace llm_cpu
