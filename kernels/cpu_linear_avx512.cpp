// llm_cpu::linear's tiles for AVX-512 (see cpu_linear.cpp), called only where the CPU has it.
// Compiled for AVX-512 (as is cpu_paged_attention_avx512.cpp) by the pragma below (the build's flags are
// AVX2's); it includes nothing but the intrinsics and cpu_linear_tiles.h (see there why).
#pragma GCC target("avx2,fma,avx512f")

#define LLM_CPU_AVX512
#include "cpu_linear_tiles.h"

namespace llm_cpu {

// With 32 vector registers a tile holds 12 x rows times a 32-column panel (24 accumulators).
void linear_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1) { panels<Avx512>(a, p0, p1); }
void linear_q4_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1) { quant_panels<Avx512, Q4Format>(a, p0, p1); }
void linear_q8_panels_avx512(const LinearArgs& a, int64_t p0, int64_t p1) { quant_panels<Avx512, Q8Format>(a, p0, p1); }

}  // namespace llm_cpu
