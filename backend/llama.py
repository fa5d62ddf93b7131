"""Llama: a decoder-only transformer, written for serving with a paged KV cache.

Architecture (Llama 2/3, SmolLM2; Qwen2 is the same plus q/k/v biases):

    x = embed(tokens)
    for each of L layers:
        x = x + o_proj(attention(rope(q), rope(k), v))     q, k, v = qkv_proj(rms_norm(x))
        x = x + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rms_norm(x))
    logits = lm_head(rms_norm(x))                           lm_head tied to embed or its own

- RMSNorm, no biases (except Qwen2's q/k/v), SwiGLU MLP.
- Rotary position embeddings (RoPE) in the "rotate half" layout of HF transformers, base `rope_theta`,
  from a cos/sin table precomputed for every position.
- Grouped-query attention: H query heads share KVH key/value heads (H % KVH == 0); attention writes
  and reads the paged KV cache through backend.attention (rotate_and_store, then attend).

The batch is flattened: forward takes T tokens of several sequences back to back (no padding);
`AttentionMetadata` says which rows belong to which sequence and where their K/V live.

Loading: `load_weights` takes HF Llama names (model.layers.0.self_attn.q_proj.weight, ...) and fuses
q/k/v into one matrix and gate/up into one, so a layer runs 4 matmuls. On CPU in fp32, `Linear`
runs matmuls of up to 160 rows (decode steps, short prefill chunks) on the project's kernel
(kernels/cpu_linear.cpp) and longer prefills' through pre-packed oneDNN weights (see `Linear`); the
norms, rotary + cache store and silu * up run as one C++ op each (kernels/cpu_layer_ops.cpp) where
those are built, and in decode-only steps each layer is one C++ op that runs those same ops
(`Block.fused_forward`, kernels/cpu_decoder_layer.cpp).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention import AttentionMetadata, attend, rotate_and_store
from kernels import cpu_kernels
from kernels.cpu_kernels import CpuLinear

KVCache = tuple[torch.Tensor, torch.Tensor]  # (num_blocks, block_size, KVH, D) each


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # C
    intermediate_size: int  # F, the MLP width
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # KVH
    head_dim: int  # D
    max_position_embeddings: int  # the context length
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """From a HF config.json of a Llama or Qwen2 model; refuses features this model lacks."""
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise NotImplementedError(f"model_type {model_type!r} is not supported (llama, qwen2)")
        rope = d.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta here
        scaling = d.get("rope_scaling") or rope
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise NotImplementedError(f"rope scaling {scaling!r} is not supported")
        if model_type == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
            raise NotImplementedError("Llama attention_bias / mlp_bias are not supported")
        if d.get("use_sliding_window"):
            raise NotImplementedError("sliding-window attention is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported")
        heads = d["num_attention_heads"]
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d["max_position_embeddings"],
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json transformers can load (LlamaForCausalLM or Qwen2ForCausalLM)."""
        d = asdict(self)
        del d["qkv_bias"]
        qwen = self.qkv_bias
        d.update(
            model_type="qwen2" if qwen else "llama",
            architectures=["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            hidden_act="silu",
            rope_scaling=None,
            torch_dtype="float32",
        )
        if not qwen:
            d.update(attention_bias=False, mlp_bias=False)
        return d


class Linear(nn.Module):
    """y = x @ W.T (+ b), with two CPU fast paths for fp32 (weights arrive through `load`):

    - up to cpu_kernels.MAX_LINEAR_ROWS rows (decode steps, short prefill chunks): the kernel
      kernels/cpu_linear.cpp (AVX2, and AVX-512 where the CPU has it) on a copy of W packed in 32-column
      panels, bias and residual added in its epilogue. On SmolLM2's matrices on 2 cores it reads one
      row's weights at the machine's read bandwidth and is faster than oneDNN up to ~150 rows
      (benchmarks/cpu_linear_bench.py; figures in docs/kernels.md). Where it could not be built, one
      row runs as a split bmm: W viewed as (S, N/S, K) for S threads, one batched matmul, each thread
      streaming its own slice of W (13-14 GB/s; plain F.linear / mv read 7-8 GB/s);
    - more rows (long prefills), or any rows without the kernel: W pre-packed for oneDNN (torch.ops.mkldnn,
      what torch.compile's CPU freezing uses), 1.5-2x the GFLOP/s of F.linear at 16-128 rows.

    So on CPU the weight is held three times (plain, panels, oneDNN's). `.to(...)` drops and rebuilds the
    packed copies.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(torch.empty(out_features, in_features, device=device, dtype=dtype))  # (N, K)
        self.bias = _param(torch.empty(out_features, device=device, dtype=dtype)) if bias else None  # (N,)
        self._packed: torch.Tensor | None = None  # oneDNN layout of weight (CPU fp32 only)
        self._split: tuple[int, torch.Tensor] | None = None  # (threads, weight viewed as (S, N/S, K))
        self._kernel: CpuLinear | None = None  # kernels/cpu_linear.cpp, where it was built (CPU fp32 only)
        self._panels: torch.Tensor | None = None  # weight packed for it: (ceil(N / 32), K, 32)

    def load(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        assert weight.shape == self.weight.shape, f"weight {tuple(weight.shape)} != {tuple(self.weight.shape)}"
        self.weight.copy_(weight)
        if self.bias is not None:
            assert bias is not None and bias.shape == self.bias.shape, "missing or misshapen bias"
            self.bias.copy_(bias)
        self.repack()

    def repack(self) -> None:
        """Rebuild the packed copies after the weight changed (load, tying, .to())."""
        w = self.weight
        packable = w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None) if packable else None
        self._split = None
        self._kernel = cpu_kernels.linear() if packable else None
        self._panels = cpu_kernels.pack_linear_weight(w.detach()) if self._kernel is not None else None
        if packable:
            self._split_weight()
            _PACKED_WEIGHTS[w.data_ptr()] = self._packed
            weakref.finalize(w, _PACKED_WEIGHTS.pop, w.data_ptr(), None)  # no packed copy outlives its weight

    def _split_weight(self) -> None:
        N, K, S = self.out_features, self.in_features, torch.get_num_threads()
        parts = S if N % S == 0 else 1
        self._split = (S, self.weight.view(parts, N // parts, K))  # (S, N/S, K) view

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, K) -> (T, N); with `residual` (T, N), returns residual + x @ W.T in one op."""
        if self._packed is None:
            y = F.linear(x, self.weight, self.bias)  # (T, N)
            return y if residual is None else residual + y
        T = x.shape[0]
        # A compiled graph serves every batch size >= 2 with one trace, so it must not branch on T there.
        if self._kernel is not None and (T == 1 or (not torch.compiler.is_compiling() and T <= cpu_kernels.MAX_LINEAR_ROWS)):
            residual = None if residual is None else residual.contiguous()
            return self._kernel(x.contiguous(), self._panels, self.out_features, self.bias, residual)  # (T, N)
        if T == 1:
            return self._one_row(x, residual)  # (1, N)
        if torch.compiler.is_compiling():  # inductor cannot lower the oneDNN op itself: an opaque call
            y = packed_linear(x, self.weight)  # (T, N)
            y = y if self.bias is None else y + self.bias
        else:
            y = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")  # (T, N)
        return y if residual is None else residual + y

    def _one_row(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The split bmm, where the kernel is not built."""
        N, K = self.out_features, self.in_features
        if self._split is None or (not torch.compiler.is_compiling() and self._split[0] != torch.get_num_threads()):
            self._split_weight()  # (a compiled graph keeps the split it was traced with)
        w = self._split[1]
        S = w.shape[0]
        if x.stride(-1) != 1:
            x = x.contiguous()
        # x as a (K, 1) column with strides (1, K) (MKL's fast path; strides (1, 1) run 3x slower),
        # shared by the S slices (stride 0).
        col = x.as_strided((S, K, 1), (0, 1, K))  # (S, K, 1)
        if residual is not None and self.bias is None:
            return torch.baddbmm(residual.reshape(S, N // S, 1), w, col).view(1, N)  # (1, N)
        if torch.compiler.is_compiling():
            # Opaque to inductor, which would otherwise fuse this bmm with the element-wise ops
            # around it into its own C++ loop: 30-40% slower than MKL's at the bandwidth bound.
            y = split_matvec(col, w).view(1, N)  # (1, N)
        else:
            y = torch.bmm(w, col).view(1, N)  # (1, N)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else y + residual

    def _apply(self, fn, recurse: bool = True):  # behind .to(), .cuda(), .half(), ...
        self._packed, self._split, self._kernel, self._panels = None, None, None, None
        super()._apply(fn, recurse)
        self.repack()
        return self

    def extra_repr(self) -> str:
        packed = self._packed is not None
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, packed={packed}"


# oneDNN copies by the data pointer of their plain weight, for `packed_linear` (a compiled graph
# carries the plain weight; an opaque-layout tensor cannot pass through torch.compile's fake tensors).
_PACKED_WEIGHTS: dict[int, torch.Tensor] = {}


@torch.library.custom_op("llm_backend::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K) @ weight (N, K).T through weight's oneDNN-packed copy -> (T, N)."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[weight.data_ptr()], None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("llm_backend::split_matvec", mutates_args=())
def split_matvec(col: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight (S, N/S, K) @ col (S, K, 1) -> (S, N/S, 1): torch.bmm, kept whole under torch.compile."""
    return torch.bmm(weight, col)


@split_matvec.register_fake
def _(col: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return col.new_empty(weight.shape[0], weight.shape[1], 1)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)  # inference only: weights never need gradients


class RMSNorm(nn.Module):
    """x * weight / sqrt(mean(x^2) + eps) over the last dim (weights arrive through `load`).

    On CPU in fp32: the C++ op of kernels/cpu_layer_ops.cpp where it is built (7 us for one row);
    without it, and under torch.compile, (x * weight*sqrt(C)) / hypot(||x||, sqrt(C*eps)): the same
    value (3e-7 relative) in four ops instead of the eight F.rms_norm dispatches on CPU (19 vs 41 us for
    one row). Elsewhere F.rms_norm (one fused kernel on CUDA).
    """

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(torch.empty(dim, device=device, dtype=dtype))  # (C,)
        self._scaled: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight * sqrt(C), sqrt(C * eps))

    def load(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight)
        self._rescale()

    def _rescale(self) -> None:
        w = self.weight.detach()
        C = w.shape[0]
        cpu_fp32 = w.device.type == "cpu" and w.dtype == torch.float32
        self._scaled = (w * math.sqrt(C), torch.tensor(math.sqrt(C * self.eps), dtype=w.dtype)) if cpu_fp32 else None

    def _apply(self, fn, recurse: bool = True):  # behind .to(): rebuild for the new device and dtype
        super()._apply(fn, recurse)
        self._rescale()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, C) -> (T, C)."""
        if self._scaled is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if (ops := cpu_kernels.layer_ops_for(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)  # (T, C)
        weight, eps_norm = self._scaled
        return torch.div(x * weight, torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), eps_norm))


def rope_tables(config: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: (max_positions, D) fp32, so that rope(x) = x * cos + roll_half(x) * sin.

    HF computes x * cos + rotate_half(x) * sin with rotate_half(x) = (-x2, x1); roll_half(x) = (x2, x1)
    with sin's first half negated gives the same products, bit for bit.
    """
    D = config.head_dim
    exponents = torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D  # (D/2,)
    inv_freq = 1.0 / (config.rope_theta**exponents)  # (D/2,)
    pos = torch.arange(config.max_position_embeddings, device=device).float()  # (P,)
    freqs = pos[:, None] * inv_freq[None, :]  # (P, D/2)
    cos, sin = freqs.cos(), freqs.sin()  # (P, D/2)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (P, D), (P, D)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.H, self.KVH, self.D = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.scale = 1.0 / math.sqrt(self.D)
        C, H, KVH, D = config.hidden_size, self.H, self.KVH, self.D
        self.qkv_proj = Linear(C, (H + 2 * KVH) * D, config.qkv_bias, device, dtype)  # q, k, v stacked
        self.o_proj = Linear(H * D, C, False, device, dtype)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata, residual: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states (T, C) -> residual + attention output (T, C)."""
        T, H, D = x.shape[0], self.H, self.D
        qkv = self.qkv_proj.forward(x)  # (T, (H + 2*KVH) * D)
        q = rotate_and_store(qkv, cos, sin, kv_cache[0], kv_cache[1], meta, H, self.KVH)  # (T, H, D); K, V cached
        o = attend(q, kv_cache[0], kv_cache[1], meta, self.scale)  # (T, H, D)
        return self.o_proj.forward(o.reshape(T, H * D), residual)  # (T, C)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        C, Fw = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(C, 2 * Fw, False, device, dtype)  # gate, up stacked
        self.down_proj = Linear(Fw, C, False, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x: the normed hidden states (T, C) -> residual + MLP output (T, C)."""
        gate_up = self.gate_up_proj.forward(x)  # (T, 2F)
        if (ops := cpu_kernels.layer_ops_for(gate_up)) is not None:
            return self.down_proj.forward(ops.silu_mul(gate_up), residual)  # (T, C)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, F), (T, F)
        return self.down_proj.forward(F.silu(gate) * up, residual)  # (T, C)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = MLP(config, device, dtype)

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # Submodules' .forward is called directly: nn.Module.__call__ costs microseconds, times ~10
        # calls per layer, times every layer, on every step (batch-1 decode is overhead-bound).
        # The residual add happens inside o_proj and down_proj.
        x = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv_cache, meta, residual=x)  # (T, C)
        return self.mlp.forward(self.post_attention_layernorm.forward(x), residual=x)  # (T, C)

    def fused_forward(self, op, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """forward as one call of `op` = llm_cpu::decoder_layer (see LlamaForCausalLM._fused_layer): the
        same C++ ops in the same order, without Python between them. x (T, C) -> (T, C)."""
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        return op(x, norm1.weight, norm1.eps, qkv._panels, qkv.out_features, qkv.bias, o._panels, o.out_features,
                  norm2.weight, norm2.eps, gate_up._panels, gate_up.out_features, down._panels, down.out_features,
                  cos, sin, kv_cache[0], kv_cache[1], meta.slot_mapping, meta.block_tables, meta.seq_lens,
                  attn.H, attn.KVH, attn.scale)  # (T, C)


# For torch.compile (backend/compiled_decode.py): every layer runs the same graph, traced and compiled
# once instead of 30 times. Eager mode calls Block.forward itself (the region's wrapper costs ~20 us).
_block_region = torch.compiler.nested_compile_region(Block.forward)


class LlamaForCausalLM(nn.Module):
    """Build on the target device and dtype, then `load_weights` (parameters start uninitialized)."""

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None, dtype=torch.float32) -> None:
        super().__init__()
        self.config = config
        C, V = config.hidden_size, config.vocab_size
        self.embed_tokens = _param(torch.empty(V, C, device=device, dtype=dtype))
        self.layers = nn.ModuleList(Block(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(C, config.rms_norm_eps, device, dtype)
        self.lm_head = Linear(C, V, False, device, dtype)  # tied: loaded from embed_tokens
        cos, sin = rope_tables(config, device)
        self.register_buffer("rope_cos", cos, persistent=False)  # (P, D) fp32
        self.register_buffer("rope_sin", sin, persistent=False)  # (P, D) fp32

    def _tie_lm_head(self) -> None:
        self.lm_head.weight = self.embed_tokens  # shared, as in HF
        self.lm_head.repack()

    def _apply(self, fn, recurse: bool = True):  # behind .to(): keep a tied lm_head tied
        super()._apply(fn, recurse)
        if self.config.tie_word_embeddings:
            self._tie_lm_head()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final-normed hidden states (T, C).

        Call under torch.inference_mode() or torch.no_grad() (the compiled decode path needs the latter)."""
        x = F.embedding(input_ids, self.embed_tokens)  # (T, C)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)  # (T, 1, D)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)  # (T, 1, D)
        if (fused := self._fused_layer(x, kv_caches, meta)) is not None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x = layer.fused_forward(fused, x, cos, sin, kv_cache, meta)  # (T, C)
            return self.norm.forward(x)  # (T, C)
        block_forward = _block_region if torch.compiler.is_compiling() else Block.forward
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = block_forward(layer, x, cos, sin, kv_cache, meta)  # (T, C)
        return self.norm.forward(x)  # (T, C)

    def _fused_layer(self, x: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata):
        """llm_cpu::decoder_layer where this step may take it, else None: eager, decode only, up to
        MAX_LINEAR_ROWS rows, CPU fp32 with every op Block.forward would run in C++ there (packed
        linears, the C++ norm, contiguous caches the decode kernel reads)."""
        if torch.compiler.is_compiling() or meta.num_decode_seqs != meta.num_seqs or meta.decode_plan is not None:
            return None
        if x.shape[0] > cpu_kernels.MAX_LINEAR_ROWS or x.device.type != "cpu" or x.dtype != torch.float32:
            return None
        first = self.layers[0]
        if first.self_attn.qkv_proj._panels is None or first.input_layernorm._scaled is None:
            return None
        k_cache, v_cache = kv_caches[0]
        if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        return cpu_kernels.decoder_layer()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, C) of the rows to sample from -> logits (S, V) in fp32.
        (Not under inference_mode, so the caller may edit the logits in place wherever it runs.)"""
        return self.lm_head(hidden).float()  # (S, V)

    @torch.inference_mode()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in (any dtype/device; converted), fusing q/k/v and gate/up.
        Every expected weight must be present and nothing else may be (rotary inv_freq aside)."""
        cfg = self.config
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise KeyError(f"missing weight {name}")
            used.add(name)
            return state_dict[name]

        self.embed_tokens.copy_(take("model.embed_tokens.weight"))
        self.norm.load(take("model.norm.weight"))
        if cfg.tie_word_embeddings:
            used.add("lm_head.weight")  # some tied checkpoints still carry a copy
            self._tie_lm_head()
        else:
            self.lm_head.load(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.input_layernorm.load(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.load(take(p + "post_attention_layernorm.weight"))
            qkv = [take(f"{p}self_attn.{n}_proj.weight").to(self.embed_tokens) for n in "qkv"]
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([take(f"{p}self_attn.{n}_proj.bias").to(self.embed_tokens) for n in "qkv"])
            layer.self_attn.qkv_proj.load(torch.cat(qkv), bias)  # ((H + 2*KVH) * D, C)
            layer.self_attn.o_proj.load(take(p + "self_attn.o_proj.weight"))
            gate_up = [take(f"{p}mlp.{n}_proj.weight").to(self.embed_tokens) for n in ("gate", "up")]
            layer.mlp.gate_up_proj.load(torch.cat(gate_up))  # (2F, C)
            layer.mlp.down_proj.load(take(p + "mlp.down_proj.weight"))
        unexpected = sorted(k for k in state_dict if k not in used and not k.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise KeyError(f"unexpected weights: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
