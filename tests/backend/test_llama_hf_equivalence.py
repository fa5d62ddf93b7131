"""backend/models (Llama, Qwen2) against Hugging Face transformers' LlamaForCausalLM / Qwen2ForCausalLM (fp32, CPU).

Both models get the same config and the same HF-named state dict. Ours runs through a minimal
paged driver (`PagedDriver`): sequence s owns KV blocks s, s + S, s + 2S, ... (interleaved, so a
wrong block lookup cannot pass by accident), and prompts start one step apart, so steps 1..4 are
mixed batches (earlier sequences decoding, one prompt prefilling) as the engine builds them.
HF runs each prompt alone with its own KV cache.

Checked: the logits of each prompt's first step (atol 1e-3) and 32 greedy tokens (equal); and the
engine's prompt logprobs of five prompts (atol 1e-4).
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from backend.attention import AttentionMetadata, allocate_kv_caches
from backend.checkpoint import load_checkpoint
from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.models import LlamaConfig, Qwen2Config, build_model
from backend.models.llama import LlamaForCausalLM
from benchmarks.hf_peer import build_hf_model
from protocol import SamplingParams, StepOutput

NEW_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a machine shared with other jobs, two OpenMP threads stall on every
    op whenever one core is busy (measured 5-7x slower here); the comparison needs no speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class PagedDriver:
    """Feeds a flattened batch of (sequence, new tokens) items through the model with a paged cache."""

    def __init__(self, model: LlamaForCausalLM, num_seqs: int, max_len: int, block_size: int = 16) -> None:
        cfg = model.config
        self.model, self.num_seqs, self.block_size = model, num_seqs, block_size
        self.blocks_per_seq = math.ceil(max_len / block_size)
        self.kv_caches = allocate_kv_caches(
            cfg.num_hidden_layers,
            num_seqs * self.blocks_per_seq,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            torch.float32,
        )
        self.cached = [0] * num_seqs  # tokens of each sequence already in the cache

    def block(self, seq: int, i: int) -> int:
        return i * self.num_seqs + seq

    def step(self, items: list[tuple[int, list[int]]]) -> torch.Tensor:
        """items: (seq, new token ids), single-token items of started sequences first (decodes).
        Returns the logits of each item's last token: (len(items), vocab)."""
        ids, positions, slots, seq_lens, qsl, tables = [], [], [], [], [0], []
        num_decode = 0
        for seq, tokens in items:
            start = self.cached[seq]
            if len(tokens) == 1 and start > 0 and num_decode == len(qsl) - 1:
                num_decode += 1
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [
                self.block(seq, p // self.block_size) * self.block_size + p % self.block_size
                for p in range(start, start + len(tokens))
            ]
            seq_lens.append(start + len(tokens))
            qsl.append(qsl[-1] + len(tokens))
            tables.append([self.block(seq, i) for i in range(self.blocks_per_seq)])
            self.cached[seq] += len(tokens)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode_seqs=num_decode,
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)  # (T, C)
        return self.model.compute_logits(hidden[torch.tensor(qsl[1:]) - 1])  # (items, V)


def run_ours(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int):
    """Staggered greedy generation: prompt i prefills at step i while earlier ones decode.
    Returns (first-step logits per prompt, generated tokens per prompt)."""
    n = len(prompts)
    driver = PagedDriver(model, n, max(map(len, prompts)) + new_tokens)
    first_logits: list[torch.Tensor | None] = [None] * n
    out: list[list[int]] = [[] for _ in range(n)]
    step = 0
    while any(len(o) < new_tokens for o in out):
        items = [(s, [out[s][-1]]) for s in range(min(step, n)) if len(out[s]) < new_tokens]
        if step < n:
            items.append((step, prompts[step]))
        logits = driver.step(items)
        for (s, _), row in zip(items, logits):
            if first_logits[s] is None:
                first_logits[s] = row
            out[s].append(int(row.argmax()))
        step += 1
    return first_logits, out


def hf_model(config: LlamaConfig, state_dict: dict[str, torch.Tensor]) -> transformers.PreTrainedModel:
    return build_hf_model(config, state_dict, attn_implementation="eager")


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], new_tokens: int):
    first_logits, out = [], []
    for prompt in prompts:
        result = model(input_ids=torch.tensor([prompt]), use_cache=True)
        first_logits.append(result.logits[0, -1].float())
        tokens = []
        for _ in range(new_tokens):
            tokens.append(int(result.logits[0, -1].argmax()))
            if len(tokens) == new_tokens:
                break
            result = model(input_ids=torch.tensor([[tokens[-1]]]), cache=result.cache, use_cache=True)
        out.append(tokens)
    return first_logits, out


# --------------------------------------------------------------------------------------- tiny random


def random_hf_state_dict(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_dict())
    cls = getattr(transformers, config.architecture)
    model = cls(hf_config)
    with torch.no_grad():
        for p in model.parameters():  # larger than HF's init, so logits are far from uniform
            p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    head_dim=8,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=1000.0,
)


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False),
        LlamaConfig(**TINY, num_attention_heads=6, num_key_value_heads=6, tie_word_embeddings=True),
        Qwen2Config(**TINY, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False),
    ],
    ids=["llama-gqa-untied", "llama-mha-tied", "qwen2-mqa-bias"],
)
def test_tiny_random_models_match_hf(config):
    state_dict = random_hf_state_dict(config, seed=0)
    ours = build_model(config)
    ours.load_weights(state_dict)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (7, 1, 20, 33)]
    ours_first, ours_out = run_ours(ours, prompts, new_tokens=12)
    hf_first, hf_out = run_hf(hf_model(config, state_dict), prompts, new_tokens=12)
    for a, b in zip(ours_first, hf_first):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert ours_out == hf_out


def test_chunked_prefill_matches_one_shot_prefill():
    config = LlamaConfig(**TINY, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.load_weights(random_hf_state_dict(config, seed=2))
    prompt = torch.randint(0, config.vocab_size, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = PagedDriver(model, 1, 64).step([(0, prompt)])
    chunked = PagedDriver(model, 1, 64)
    for lo in range(0, 41, 9):  # chunks of 9, not block-aligned: each attends to the cached prefix
        last = chunked.step([(0, prompt[lo : lo + 9])])
    torch.testing.assert_close(last, whole, atol=1e-5, rtol=1e-5)


def test_load_weights_rejects_missing_and_unexpected_names():
    config = LlamaConfig(**TINY, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    state_dict = random_hf_state_dict(config, seed=0)
    with pytest.raises(KeyError, match="missing weight lm_head.weight"):
        LlamaForCausalLM(config).load_weights({k: v for k, v in state_dict.items() if k != "lm_head.weight"})
    with pytest.raises(KeyError, match="unexpected weights: model.extra"):
        LlamaForCausalLM(config).load_weights({**state_dict, "model.extra": torch.zeros(1)})


# --------------------------------------------------------------------------------------- SmolLM2

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    "Write a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2_runs(one_thread):
    ckpt = load_checkpoint("smollm2")
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    ours = LlamaForCausalLM(ckpt.config)
    ours.load_weights(ckpt.state_dict)
    ours_result = run_ours(ours, prompts, NEW_TOKENS)
    hf_result = run_hf(hf_model(ckpt.config, ckpt.state_dict), prompts, NEW_TOKENS)
    return ckpt, ours_result, hf_result


@pytest.mark.model
def test_smollm2_first_step_logits_match_hf(smollm2_runs):
    _, (ours_first, _), (hf_first, _) = smollm2_runs
    for i, (a, b) in enumerate(zip(ours_first, hf_first)):
        assert a.shape == b.shape == (49152,)
        err = (a - b).abs().max().item()
        assert err < 1e-3, f"prompt {i}: max |logit diff| {err}"


@pytest.mark.model
def test_smollm2_greedy_tokens_match_hf(smollm2_runs):
    ckpt, (_, ours_out), (_, hf_out) = smollm2_runs
    for i, (a, b) in enumerate(zip(ours_out, hf_out)):
        assert a == b, f"prompt {i}: {ckpt.tokenizer.decode(a)!r} != {ckpt.tokenizer.decode(b)!r}"
    # And the weights are right, not merely equal in both models (e.g. the Q/K un-permutation):
    assert ckpt.tokenizer.decode(ours_out[0]).startswith("The capital of France is Paris")


@pytest.mark.model
def test_smollm2_engine_prompt_logprobs_match_hf(smollm2_runs):
    """The served engine's prompt logprobs (chunked prefill, all five prompts in one batch) against
    transformers' log_softmax over each whole prompt."""
    ckpt, _, _ = smollm2_runs
    engine = LLMEngine(
        EngineConfig(max_num_batched_tokens=32, num_kv_blocks=64, block_size=16, num_threads=1), checkpoint=ckpt
    )
    prompts = [ckpt.tokenizer.encode(p) for p in PROMPTS]
    for i, ids in enumerate(prompts):
        engine.add_request(engine.make_request(f"p{i}", ids, SamplingParams(max_tokens=1, prompt_logprobs=2)))
    firsts = {}
    while engine.has_work():
        for out in engine.step():
            if isinstance(out, StepOutput) and out.step == 0:
                firsts[out.request_id] = out.prompt_logprobs
    model = hf_model(ckpt.config, ckpt.state_dict)
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            reference = model(input_ids=torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)  # (P-1, V)
        expected = reference.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        got = firsts[f"p{i}"]
        err = (torch.tensor(got.logprobs) - expected).abs().max().item()
        assert err < 1e-4, f"prompt {i}: max |prompt logprob diff| {err}"
        top_err = (torch.tensor(got.top_logprobs) - reference.topk(2).values).abs().max().item()
        assert top_err < 1e-4, f"prompt {i}: max |top logprob diff| {top_err}"
