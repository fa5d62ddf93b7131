// AVX2 helpers shared by the C++ CPU kernels (cpu_linear.cpp, cpu_paged_attention.cpp).
#pragma once

#include <immintrin.h>

namespace llm_cpu {

// The sum of a vector's 8 floats.
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

}  // namespace llm_cpu
