// The C++ entry points of the llm_cpu ops, for other ops of the library to call without the dispatcher
// (cpu_decoder_layer.cpp). Each is the op of the same name; defined in the file named.
#pragma once

#include <optional>

#include <ATen/ATen.h>

namespace llm_cpu::ops {

// cpu_linear.cpp
bool avx512_on();  // whether the AVX-512 paths run: where the CPU has AVX-512, unless switched off (use_avx512)
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& residual);
// cpu_layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                         at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);
// cpu_paged_attention.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale);

}  // namespace llm_cpu::ops
