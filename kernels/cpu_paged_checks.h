// The paged cache's input check shared by the C++ attention kernels (cpu_paged_attention.cpp,
// cpu_paged_prefill.cpp), run once before their parallel loops.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>

namespace llm_cpu {

// Sequence b's first ceil(L / BS) block-table entries must name cache blocks (0 <= block < NB), so that a
// kernel walking its L positions cannot read outside the cache.
inline void check_block_table(const int32_t* tables, int64_t max_blocks, int64_t b, int64_t L, int64_t BS, int64_t NB) {
  for (int64_t j = 0; j < (L + BS - 1) / BS; ++j) {
    const int64_t block = tables[b * max_blocks + j];
    TORCH_CHECK(block >= 0 && block < NB, "block_tables[", b, ", ", j, "] = ", block, " is not a cache block");
  }
}

}  // namespace llm_cpu
