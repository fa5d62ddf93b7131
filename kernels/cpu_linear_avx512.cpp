// llm_cpu::linear's tiles for AVX-512 (see cpu_linear.cpp), called only where the CPU has it.
// This file alone is compiled for AVX-512, by the pragma below (the build's flags are AVX2's), and it
// includes nothing but the intrinsics and cpu_linear_tiles.h (see there why).
#pragma GCC target("avx2,fma,avx512f")

#define LLM_CPU_AVX512
#include "cpu_linear_tiles.h"

namespace llm_cpu {

// With 32 vector registers a tile holds up to 6 x rows by 4 weight rows (24 accumulators). The x rows
// are split in passes of equal size (13 rows: 5 + 4 + 4, not 6 + 6 + 1), so no pass is a thin one that
// reads the weight tile again for little arithmetic. cpu_linear_bench.py's workload, Intel Xeon VM, in
// one process: against 6-row passes and their remainder, 10-20 rows up to 1.3x faster; against
// 8 x 3 tiles, 1.2-1.5x.
void linear_rows_avx512(const LinearArgs& p, int64_t n0, int64_t n1) {
  if (p.M == 1) {
    weight_rows<Avx512, 1, 8>(p, n0, n1);
    return;
  }
  const int64_t passes = (p.M + 5) / 6;
  switch ((p.M + passes - 1) / passes) {
    case 2: weight_rows<Avx512, 2, 4>(p, n0, n1); break;
    case 3: weight_rows<Avx512, 3, 4>(p, n0, n1); break;
    case 4: weight_rows<Avx512, 4, 4>(p, n0, n1); break;
    case 5: weight_rows<Avx512, 5, 4>(p, n0, n1); break;
    default: weight_rows<Avx512, 6, 4>(p, n0, n1); break;
  }
}

}  // namespace llm_cpu
