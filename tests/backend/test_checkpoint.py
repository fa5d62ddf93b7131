"""backend.checkpoint and tokenization.tokenizer: what the SmolLM2 GGUF says, the cache, HF folders."""

from __future__ import annotations

import json

import jinja2
import pytest
import torch

from backend import checkpoint
from backend.checkpoint import (
    Checkpoint,
    _unpermute_rope_rows,
    load_checkpoint,
    load_gguf,
    resolve_source,
    smollm2_gguf_path,
)
from backend.models import LlamaConfig, Qwen2Config, config_from_hf
from tokenization.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "<|im_start|>user\nWhat is 12.5 * 2024?<|im_end|>\n<|im_start|>assistant\n",
    "  two leading spaces, a tab\tand\n\nnewlines  ",
    "Ünïcödé: 日本語のテキスト, emoji 🤖🎉, Ελληνικά",
    "def f(x):\n    return x ** 2  # comment",
    "don't we'll it's I'M",
    "<|endoftext|><file_sep><repo_name>",
]


@pytest.fixture(scope="module")
def ckpt() -> Checkpoint:
    return load_checkpoint("smollm2")


@pytest.mark.model
def test_config_read_from_gguf(ckpt):
    cfg = ckpt.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (64, 1536, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5  # float32 in the GGUF, rounded back
    assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings and not cfg.qkv_bias


@pytest.mark.model
def test_state_dict_has_hf_names_and_shapes(ckpt):
    sd = ckpt.state_dict
    assert len(sd) == 2 + 30 * 9  # embed, final norm, 9 per layer; no lm_head (tied)
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.29.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 for t in sd.values())


@pytest.mark.model
def test_tokenizer_round_trip_and_special_tokens(ckpt):
    tok = ckpt.tokenizer
    assert tok.vocab_size == 49152
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]  # specials parsed, no BOS added
    assert tok.decode([1, 4093, 2]) == "user"  # specials skipped by default
    assert tok.encode("12") == [33, 34]  # one token per digit, as SmolLM2 was trained
    assert tok.token_text(2) == "<|im_end|>" and tok.token_text(905) == " world"
    assert tok.special_token_ids == frozenset(range(17))


@pytest.mark.model
def test_eos_bos_and_chat_template(ckpt):
    tok = ckpt.tokenizer
    assert tok.eos_token_ids == (2, 0)  # <|im_end|> (GGUF / HF generation_config), then <|endoftext|>
    assert tok.eos_token == "<|im_end|>"
    assert (tok.bos_token_id, tok.bos_token) == (1, "<|im_start|>")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(tok.chat_template).render(
        messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.model
def test_gguf_is_converted_once_into_a_hf_cache_folder(ckpt, tmp_path, monkeypatch):
    direct = load_gguf(smollm2_gguf_path())  # no cache involved
    conversions = []
    monkeypatch.setattr(checkpoint, "load_gguf", lambda path: conversions.append(path) or direct)
    monkeypatch.setenv("LLM_CACHE_DIR", str(tmp_path))
    first = load_checkpoint("smollm2")  # converts into tmp_path
    second = load_checkpoint("smollm2")  # reads the cache
    assert len(conversions) == 1
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    as_hf = load_checkpoint(str(folder), dtype=torch.bfloat16)  # the folder is a HF source too
    for other in (direct, first, second, as_hf):
        assert other.config == ckpt.config
        assert other.tokenizer.eos_token_ids == ckpt.tokenizer.eos_token_ids
        assert other.tokenizer.chat_template == ckpt.tokenizer.chat_template
        assert [other.tokenizer.encode(t) for t in TEXTS] == [ckpt.tokenizer.encode(t) for t in TEXTS]
        assert other.state_dict.keys() == ckpt.state_dict.keys()
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(direct.state_dict[name], ckpt.state_dict[name])
    assert torch.equal(second.state_dict[name], ckpt.state_dict[name])
    assert as_hf.state_dict[name].dtype == torch.bfloat16
    assert torch.equal(as_hf.state_dict[name], ckpt.state_dict[name].to(torch.bfloat16))


@pytest.mark.model
@pytest.mark.slow
def test_direct_gguf_tokenizer_equals_transformers_conversion(ckpt):
    """Our tokenizer is built straight from the GGUF vocabulary; transformers' converter agrees,
    except on digits: it drops SmolLM's split-every-digit pre-tokenizer (llama.cpp's "smollm" type
    and HF's original tokenizer.json keep it), which changes how spaces before digits merge."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = TEXTS + ["x" * 50 + " long  spaces   here ", "\u00a0non-breaking\u2009thin space\u200bzero width"]
    for text in texts:
        if not any(c.isdigit() for c in text):
            assert ckpt.tokenizer.encode(text) == hf.encode(text, add_special_tokens=False), text
    assert [ckpt.tokenizer.token_text(i) for i in ckpt.tokenizer.encode("a  12")] == ["a", "  ", "1", "2"]


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(_unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)


# A config small enough to write by hand (the folder tests need no real weights).
TINY_CONFIG = LlamaConfig(
    vocab_size=4,
    hidden_size=8,
    intermediate_size=8,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    tie_word_embeddings=True,
)


def test_hf_folder_source(tmp_path):
    from safetensors.torch import save_file
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models

    config = TINY_CONFIG
    (tmp_path / "config.json").write_text(json.dumps({**config.to_hf_dict(), "eos_token_id": 3}))
    save_file({"model.norm.weight": torch.ones(8, dtype=torch.float16)}, str(tmp_path / "model.safetensors"))
    fast = FastTokenizer(models.WordLevel({"a": 0, "b": 1, "<s>": 2, "</s>": 3}, unk_token="a"))
    fast.add_special_tokens(["<s>", "</s>"])
    fast.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>"},
                "add_bos_token": True,
                "chat_template": [{"name": "default", "template": "{{ messages }}"}],
            }
        )
    )
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config == config
    assert ckpt.state_dict["model.norm.weight"].dtype == torch.float32
    tok: Tokenizer = ckpt.tokenizer
    assert tok.eos_token_ids == (3,) and tok.bos_token_id == 2 and tok.eos_token == "</s>"
    assert tok.encode("a") == [2, 0]  # add_bos_token
    assert tok.chat_template == "{{ messages }}"


def test_bad_sources_and_unsupported_configs(tmp_path):
    with pytest.raises(FileNotFoundError):
        resolve_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_source(str(tmp_path))
    base = TINY_CONFIG.to_hf_dict()
    with pytest.raises(NotImplementedError, match="rope scaling"):
        config_from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(NotImplementedError, match="model_type"):
        config_from_hf({**base, "model_type": "mistral"})
    with pytest.raises(NotImplementedError, match="MistralForCausalLM"):
        config_from_hf({**base, "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    v5 = {k: v for k, v in base.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}  # transformers >= 5 layout
    assert config_from_hf(v5).rope_theta == 5e5
    qwen2 = config_from_hf({**base, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.qkv_bias and isinstance(qwen2, Qwen2Config)
    assert config_from_hf({k: v for k, v in base.items() if k != "architectures"}) == config_from_hf(base)
