"""The peer: Hugging Face transformers' LlamaForCausalLM holding exactly our checkpoint's weights."""

from __future__ import annotations

import torch
import transformers

from backend.checkpoint import Checkpoint


def build_hf_model(checkpoint: Checkpoint) -> transformers.LlamaForCausalLM:
    cfg = checkpoint.config
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        torch_dtype=torch.float32,
    )
    model = transformers.LlamaForCausalLM(hf_config)
    missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m for m in missing), missing  # tied: the head is the embedding
    return model.eval()
