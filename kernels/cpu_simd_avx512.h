// AVX-512 helpers shared by the files compiled for AVX-512 (cpu_paged_attention_avx512.cpp,
// cpu_paged_prefill_avx512.cpp), after their target pragma. File-local (anonymous namespace): a function
// compiled for AVX-512 must never be the copy the linker keeps for an AVX2 caller (see cpu_linear_tiles.h).
// cpu_simd.h has the AVX2 versions.
#pragma once

#include <immintrin.h>

namespace llm_cpu {
namespace {

// e^x of 16 floats: cpu_simd.h's exp (Cephes' expf, within 2 ulp of std::exp on [-87.5, 88]; 0 below),
// 16 lanes wide.
inline __m512 exp16(__m512 x_in) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(x_in, _mm512_set1_ps(-87.5f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: r stays exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 above_min = _mm512_cmp_ps_mask(x_in, _mm512_set1_ps(-87.5f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(above_min, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

}  // namespace
}  // namespace llm_cpu
