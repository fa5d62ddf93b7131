"""The model registry (backend/models): a second family served end to end from a HF folder.

A tiny random Qwen2 (q/k/v biases, tied embeddings, Qwen's large rope_theta) is built and saved by
transformers itself (`save_pretrained`: config.json + model.safetensors), with the real SmolLM2
tokenizer beside it. The engine loads that folder, picks Qwen2ForCausalLM from config.json's
`architectures`, and must produce transformers' greedy tokens and first-step logprobs.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models import build_model, config_from_hf, supported_architectures
from backend.models.llama import LlamaForCausalLM
from backend.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from protocol import SamplingParams, StepOutput
from tests.engine_helpers import run_to_completion, smollm2_tokenizer

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    tok = smollm2_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6, tie_word_embeddings=True,
        eos_token_id=list(tok.eos_token_ids),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init, so logits are far from uniform
            p.normal_(0.0, 0.3) if p.dim() > 1 else p.uniform_(-0.5, 0.5)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    folder = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(folder)
    return folder, model


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy continuation (full forward each step) and its first-step log-softmax."""
    ids, first = list(prompt), None
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            first = torch.log_softmax(logits, -1) if first is None else first
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], first


def test_the_registry_reads_config_json_architectures(qwen2_folder):
    folder, _ = qwen2_folder
    hf = json.loads((folder / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"]
    config = config_from_hf(hf)
    assert isinstance(config, Qwen2Config) and config.qkv_bias and config.tie_word_embeddings
    assert config.rope_theta == 1e6
    assert type(build_model(config)) is Qwen2ForCausalLM
    assert supported_architectures() == ["LlamaForCausalLM", "Qwen2ForCausalLM"]
    with pytest.raises(NotImplementedError, match="sliding-window"):
        config_from_hf({**hf, "use_sliding_window": True})


def test_qwen2_from_a_safetensors_folder_matches_transformers(qwen2_folder):
    folder, hf_model = qwen2_folder
    engine = LLMEngine(EngineConfig(model=str(folder), block_size=8, num_kv_blocks=64, max_num_seqs=4))
    model = engine.runner.model
    assert type(model) is Qwen2ForCausalLM and isinstance(model, LlamaForCausalLM)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    prompts = [engine.tokenizer.encode(p) for p in ("The quick brown fox", "def fibonacci(n):\n", "Once")]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.make_request(f"r{i}", prompt, params))
    outputs = [o for o in run_to_completion(engine) if isinstance(o, StepOutput)]
    for i, prompt in enumerate(prompts):
        steps = [o for o in outputs if o.request_id == f"r{i}"]
        tokens = [t for o in steps for t in o.token_ids]
        want_tokens, want_first = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert tokens == want_tokens
        first = steps[0].logprobs
        torch.testing.assert_close(torch.tensor(first.top_logprobs[0]), want_first.topk(5).values, atol=1e-4, rtol=0)
        assert list(first.top_token_ids[0]) == want_first.topk(5).indices.tolist()
