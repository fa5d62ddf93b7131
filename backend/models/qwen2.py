"""Qwen2 / Qwen2.5: Llama's architecture with biases on the q, k and v projections.

Everything else is LlamaForCausalLM's: RMSNorm, SwiGLU, rotary embeddings (Qwen2 uses a larger
`rope_theta`), grouped-query attention, and tied embeddings in the small sizes. HF checkpoints name
their weights as Llama's do, plus `model.layers.N.self_attn.{q,k,v}_proj.bias`.

Refused: sliding-window attention (`use_sliding_window: true`; the released Qwen2/2.5 configs have it
off), rope scaling (YaRN long-context configs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from backend.models.llama import LlamaConfig, LlamaForCausalLM, common_hf_fields


@dataclass(frozen=True, slots=True)
class Qwen2Config(LlamaConfig):
    architecture: ClassVar[str] = "Qwen2ForCausalLM"
    model_type: ClassVar[str] = "qwen2"

    qkv_bias: bool = True

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen2Config:
        return cls(**common_hf_fields(d))

    def _hf_family_fields(self) -> dict[str, Any]:
        return {"use_sliding_window": False}


class Qwen2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM built from a Qwen2Config (its qkv_proj carries the bias)."""

    config_class: ClassVar[type[LlamaConfig]] = Qwen2Config
