"""Embeddings of the real SmolLM2 weights against transformers' (fp32, CPU, eager attention): the
engine's vector (last token's final-norm hidden state, L2-normalised; chunked prefill, several prompts
and a generation in one batch, then again from the prefix cache) against `LlamaModel`'s
last_hidden_state at the prompt's last position, normalised, over the same GGUF weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.checkpoint import load_checkpoint
from backend.config import EngineConfig
from backend.engine import LLMEngine
from benchmarks.hf_peer import build_hf_model
from protocol import SamplingParams, StepOutput, Task

PROMPTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "hi",
]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.model
def test_smollm2_embeddings_match_transformers(one_thread):
    ckpt = load_checkpoint("smollm2")
    engine = LLMEngine(
        EngineConfig(max_num_batched_tokens=32, num_kv_blocks=64, block_size=16, num_threads=1), checkpoint=ckpt
    )
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    engine.add_request(engine.make_request("g", prompts[2], SamplingParams(max_tokens=8, temperature=0.0)))
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(f"e{i}", ids, SamplingParams(), Task.EMBED))
    vectors: dict[str, tuple[float, ...]] = {}

    def run() -> None:
        while engine.has_work():
            for out in engine.step():
                if isinstance(out, StepOutput) and out.embedding is not None:
                    vectors[out.request_id] = out.embedding

    run()
    engine.add_request(engine.make_request("again", prompts[2], SamplingParams(), Task.EMBED))  # prefix cache
    run()
    model = build_hf_model(ckpt.config, ckpt.state_dict, attn_implementation="eager")
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # (C,), after the final norm
        expected = F.normalize(hidden.float(), dim=-1)
        got = torch.tensor(vectors[f"e{i}"])
        assert got.shape == expected.shape == (ckpt.config.hidden_size,)
        cosine = F.cosine_similarity(got, expected, dim=0).item()
        assert cosine >= MIN_COSINE, f"prompt {i}: cosine {cosine}"
    assert vectors["again"] == vectors["e2"]
