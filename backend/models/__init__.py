"""The model families the engine serves, keyed by the `architectures` name of a HF config.json.

A family is a config class (parses config.json, refuses what the model lacks) and a model class
(architecture only; how layers run on each device is backend/layers.py). Every model class offers
what the engine calls (`CausalLM`). To add a family: a module here with both classes, one line in
`_FAMILIES`, and a test against transformers on a tiny random model (tests/backend/test_model_families.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch

from backend.attention import AttentionMetadata
from backend.layers import KVCache
from backend.models.llama import LlamaConfig, LlamaForCausalLM
from backend.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

ModelConfig = LlamaConfig  # every family's config has (at least) Llama's fields: the engine reads those

_FAMILIES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


class CausalLM(Protocol):
    """What the engine (model runner, compiled decode) calls on a model."""

    config: ModelConfig

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor: ...  # (T,), (T,) -> final hidden states (T, C)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # (S, C) -> (S, V) fp32

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None: ...


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


def config_from_hf(d: Mapping[str, Any]) -> ModelConfig:
    """The family's config from a HF config.json (its `architectures`, which must agree with its
    `model_type`); NotImplementedError for an architecture not served here."""
    names = d.get("architectures") or []
    model_type = d.get("model_type")
    family = next((_FAMILIES[n] for n in names if n in _FAMILIES), None)
    if family is None and not names:
        family = next((f for f in _FAMILIES.values() if f.config_class.model_type == (model_type or "llama")), None)
    if family is None or model_type not in (None, family.config_class.model_type):
        raise NotImplementedError(
            f"model_type {model_type!r} / architectures {names} are not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return family.config_class.from_hf_dict(d)


def build_model(config: ModelConfig, device: torch.device | str | None = None, dtype=torch.float32) -> CausalLM:
    """An empty model of config's family (parameters uninitialized: call `load_weights`)."""
    return _FAMILIES[config.architecture](config, device, dtype)


__all__ = [
    "CausalLM",
    "LlamaConfig",
    "ModelConfig",
    "Qwen2Config",
    "build_model",
    "config_from_hf",
    "supported_architectures",
]
