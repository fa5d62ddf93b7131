"""Llama: a decoder-only transformer, written for serving with a paged KV cache.

Architecture (Llama 2/3, SmolLM2):

    x = embed(tokens)
    for each of L layers:
        x = x + o_proj(attention(rope(q), rope(k), v))     q, k, v = qkv_proj(rms_norm(x))
        x = x + down_proj(silu(gate) * up)                  gate, up = gate_up_proj(rms_norm(x))
    logits = lm_head(rms_norm(x))                           lm_head tied to embed or its own

- RMSNorm, no biases (a config may add q/k/v biases: Qwen2, backend/models/qwen2.py), SwiGLU MLP.
- Rotary position embeddings (RoPE) in the "rotate half" layout of HF transformers, base `rope_theta`,
  from a cos/sin table precomputed for every position.
- Grouped-query attention: H query heads share KVH key/value heads (H % KVH == 0); attention writes
  and reads the paged KV cache through backend.attention (rotate_and_store, then attend).

The batch is flattened: forward takes T tokens of several sequences back to back (no padding);
`AttentionMetadata` says which rows belong to which sequence and where their K/V live.

Loading: `load_weights` takes HF Llama names (model.layers.0.self_attn.q_proj.weight, ...) and fuses
q/k/v into one matrix and gate/up into one, so a layer runs 4 matmuls. How each layer runs on this
device (kernels, packed weights, one C++ call per decode layer): backend/layers.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention import AttentionMetadata, attend, rotate_and_store
from backend.layers import (
    DecoderLayerWeights,
    KVCache,
    Linear,
    RMSNorm,
    cpu_decoder_layer,
    parameter,
    rope_tables,
    run_decoder_layer,
    silu_mul,
)


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    architecture: ClassVar[str] = "LlamaForCausalLM"  # the key in backend.models' registry
    model_type: ClassVar[str] = "llama"  # config.json's model_type

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
    qkv_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """From a HF config.json of a Llama model; refuses features this model lacks."""
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise NotImplementedError("Llama attention_bias / mlp_bias are not supported")
        return cls(**common_hf_fields(d))

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json transformers can load (its `architectures` class)."""
        d = asdict(self)
        del d["qkv_bias"]
        d.update(
            model_type=self.model_type,
            architectures=[self.architecture],
            hidden_act="silu",
            rope_scaling=None,
            torch_dtype="float32",
            **self._hf_family_fields(),
        )
        return d

    def _hf_family_fields(self) -> dict[str, Any]:
        return {"attention_bias": False, "mlp_bias": False}


def common_hf_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every Llama-shaped HF config.json carries; refuses rope scaling, sliding windows and
    activations other than silu, which no model here implements."""
    rope = d.get("rope_parameters") or {}  # transformers >= 5 keeps rope_theta here
    scaling = d.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise NotImplementedError(f"rope scaling {scaling!r} is not supported")
    if d.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {d['hidden_act']!r} is not supported")
    heads = d["num_attention_heads"]
    return dict(
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
    )


class LlamaAttention(nn.Module):
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
        rows = meta.num_decode_seqs  # decode rows take the linear kernel, prompt rows oneDNN (backend/layers.py)
        qkv = self.qkv_proj.forward(x, kernel_rows=rows)  # (T, (H + 2*KVH) * D)
        q = rotate_and_store(qkv, cos, sin, kv_cache[0], kv_cache[1], meta, H, self.KVH)  # (T, H, D); K, V cached
        o = attend(q, kv_cache[0], kv_cache[1], meta, self.scale)  # (T, H, D)
        return self.o_proj.forward(o.reshape(T, H * D), residual, kernel_rows=rows)  # (T, C)


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        C, Fw = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(C, 2 * Fw, False, device, dtype)  # gate, up stacked
        self.down_proj = Linear(Fw, C, False, device, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, kernel_rows: int | None = None) -> torch.Tensor:
        """x: the normed hidden states (T, C) -> residual + MLP output (T, C)."""
        gate_up = self.gate_up_proj.forward(x, kernel_rows=kernel_rows)  # (T, 2F)
        return self.down_proj.forward(silu_mul(gate_up), residual, kernel_rows=kernel_rows)  # (T, C)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)
        attn, mlp = self.self_attn, self.mlp
        self.weights = DecoderLayerWeights(
            self.input_layernorm, attn.qkv_proj, attn.o_proj, self.post_attention_layernorm, mlp.gate_up_proj,
            mlp.down_proj, attn.H, attn.KVH, attn.scale)  # fmt: skip

    def forward(self, x, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # Submodules' .forward is called directly: nn.Module.__call__ costs microseconds, times ~10
        # calls per layer, times every layer, on every step (batch-1 decode is overhead-bound).
        # The residual add happens inside o_proj and down_proj.
        x = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv_cache, meta, residual=x)  # (T, C)
        return self.mlp.forward(
            self.post_attention_layernorm.forward(x), residual=x, kernel_rows=meta.num_decode_seqs
        )  # (T, C)


# For torch.compile (backend/compiled_decode.py): every layer runs the same graph, traced and compiled
# once instead of once per layer. Eager mode calls forward itself (the region's wrapper has a cost).
_layer_region = torch.compiler.nested_compile_region(LlamaDecoderLayer.forward)


class LlamaForCausalLM(nn.Module):
    """Build on the target device and dtype, then `load_weights` (parameters start uninitialized)."""

    config_class: ClassVar[type[LlamaConfig]] = LlamaConfig

    def __init__(self, config: LlamaConfig, device: torch.device | str | None = None, dtype=torch.float32) -> None:
        super().__init__()
        self.config = config
        C, V = config.hidden_size, config.vocab_size
        self.embed_tokens = parameter(torch.empty(V, C, device=device, dtype=dtype))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(C, config.rms_norm_eps, device, dtype)
        self.lm_head = Linear(C, V, False, device, dtype)  # tied: loaded from embed_tokens
        cos, sin = rope_tables(config.head_dim, config.rope_theta, config.max_position_embeddings, device)
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
        if (op := cpu_decoder_layer(self.layers[0].weights, x, kv_caches, meta)) is not None:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x = run_decoder_layer(op, layer.weights, x, cos, sin, kv_cache, meta)  # (T, C)
            return self.norm.forward(x)  # (T, C)
        layer_forward = _layer_region if torch.compiler.is_compiling() else LlamaDecoderLayer.forward
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer_forward(layer, x, cos, sin, kv_cache, meta)  # (T, C)
        return self.norm.forward(x)  # (T, C)

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
