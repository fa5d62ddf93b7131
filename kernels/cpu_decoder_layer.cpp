// llm_cpu::decoder_layer: one Llama decoder layer of a decode-only step on CPU, fp32, as ONE op:
//   x2 = x + o_proj(attention(rope_store_kv(qkv_proj(rms_norm(x)))))
//   y  = x2 + down_proj(silu_mul(gate_up_proj(rms_norm(x2))))
// the same ops, in the same order, as backend/models/llama.py's LlamaDecoderLayer.forward runs them one
// by one from Python (bit-identical results, tested), called here directly (cpu_ops.h).
// Why: at batch 1 a decode step is ~9 ops per layer x every layer from Python, each paying the
// interpreter, the module code around it and torch's dispatcher: a share of the step that small
// models feel (figures: docs/kernels.md). backend.layers.cpu_decoder_layer takes this path for
// decode-only steps in eager mode where every op it needs is built; prefill and mixed steps keep the
// per-op path.

#include <optional>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_ops.h"

namespace {

namespace ops = llm_cpu::ops;

// x (T, C) -> (T, C); the linears' weights packed (cpu_linear.cpp); k_cache, v_cache (NB, BS, KVH, D).
at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& ln1, double eps1, const at::Tensor& qkv_w, int64_t qkv_n,
                         const std::optional<at::Tensor>& qkv_b, const at::Tensor& o_w, int64_t o_n, const at::Tensor& ln2,
                         double eps2, const at::Tensor& gate_up_w, int64_t gate_up_n, const at::Tensor& down_w, int64_t down_n,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         int64_t num_heads, int64_t num_kv_heads, double scale) {
  const int64_t T = x.size(0);
  const at::Tensor qkv = ops::linear(ops::rms_norm(x, ln1, eps1), qkv_w, qkv_n, qkv_b, std::nullopt);  // (T, (H + 2 KVH) D)
  const at::Tensor q = ops::rope_store_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);  // (T, H, D)
  const at::Tensor o = ops::paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale);  // (T, H, D)
  const at::Tensor x2 = ops::linear(o.reshape({T, -1}), o_w, o_n, std::nullopt, x);  // (T, C)
  const at::Tensor gate_up = ops::linear(ops::rms_norm(x2, ln2, eps2), gate_up_w, gate_up_n, std::nullopt, std::nullopt);
  return ops::linear(ops::silu_mul(gate_up), down_w, down_n, std::nullopt, x2);  // (T, C)
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llm_cpu, m) {
  m.def("decoder_layer(Tensor x, Tensor ln1, float eps1, Tensor qkv_w, int qkv_n, Tensor? qkv_b, Tensor o_w, int o_n, "
        "Tensor ln2, float eps2, Tensor gate_up_w, int gate_up_n, Tensor down_w, int down_n, Tensor cos, Tensor sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "int num_heads, int num_kv_heads, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) { m.impl("decoder_layer", decoder_layer); }
