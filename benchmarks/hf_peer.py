"""The peer: Hugging Face transformers' LlamaForCausalLM (or Qwen2) holding exactly our weights.

Used by the equivalence tests (eager attention, for exact comparison) and by the benchmarks
(transformers' default attention, as users run it).
"""

from __future__ import annotations

import torch
import transformers

from backend.models import LlamaConfig


def build_hf_model(
    config: LlamaConfig, state_dict: dict[str, torch.Tensor], attn_implementation: str = "sdpa"
) -> transformers.PreTrainedModel:
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    hf_config._attn_implementation = attn_implementation
    cls = getattr(transformers, config.architecture)
    with torch.device("meta"):
        model = cls(hf_config)
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config)  # its inv_freq was on meta
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    assert not any(p.is_meta for p in model.parameters())
    return model.eval()
