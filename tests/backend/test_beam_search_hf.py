"""Beam search on the real SmolLM2 weights against transformers (fp32, CPU, eager attention):
- with EOS out of reach (min_tokens = max_tokens), against transformers' own `generate(num_beams=n)`;
- with EOS, length penalty and early stopping, against vLLM's beam search (the candidates and ranking
  of vllm/entrypoints/openai/serving_engine.py's `beam_search`) written out below over transformers'
  logits, each beam's sequence run whole.

Ours and transformers' logits differ in the last bits, so two beams whose scores tie to 1e-4 may swap
places; anywhere else the beams must be the same tokens, and their logprobs within 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from backend.checkpoint import load_checkpoint
from backend.config import EngineConfig
from backend.engine import LLMEngine
from benchmarks.hf_peer import build_hf_model
from protocol import SamplingParams, StepOutput
from tests.engine_helpers import run_to_completion

TIE = 1e-4
LOGPROB_ATOL = 1e-3


@pytest.fixture(scope="module")
def peers():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ckpt = load_checkpoint("smollm2")
    engine = LLMEngine(
        EngineConfig(max_num_batched_tokens=64, num_kv_blocks=256, block_size=16, num_threads=1), checkpoint=ckpt
    )
    model = build_hf_model(ckpt.config, ckpt.state_dict, attn_implementation="eager")
    yield engine, model, ckpt.tokenizer
    torch.set_num_threads(threads)


def ours(engine: LLMEngine, prompt: list[int], **params) -> list[tuple[tuple[int, ...], float]]:
    """(output tokens, cumulative logprob) of each returned beam, best first."""
    engine.add_request(engine.make_request("b", prompt, SamplingParams(use_beam_search=True, logprobs=0, **params)))
    outs = sorted((o for o in run_to_completion(engine) if isinstance(o, StepOutput)), key=lambda o: o.seq_index)
    return [(o.token_ids, sum(o.logprobs.logprobs)) for o in outs]


@torch.inference_mode()
def logprobs_after(model, tokens: list[int]) -> torch.Tensor:
    """(V,) log_softmax of the next token after `tokens`."""
    return torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0, -1].float(), dim=-1)


@torch.inference_mode()
def cum_logprob(model, prompt: list[int], output: tuple[int, ...]) -> float:
    logits = model(input_ids=torch.tensor([prompt + list(output)])).logits[0].float()
    lps = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return float(lps.gather(1, torch.tensor(output)[:, None]).sum())


def vllm_beam_search(model, prompt, width, max_tokens, eos, length_penalty=1.0, early_stopping=False):
    """vLLM's beam search over transformers' logits: each beam's 2n most likely tokens; an EOS one is a
    finished beam, the n best others by cumulative logprob go on; the end ranks all by
    cum / (prompt + output, EOS not counted) ** length_penalty. early_stopping: done at n finished."""
    beams = [((), 0.0)]
    done = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            top = logprobs_after(model, prompt + list(tokens)).topk(2 * width)
            for lp, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t in eos else candidates).append(((*tokens, t), cum + lp))
        if early_stopping and len(done) >= width:
            beams = []
            break
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
        if not beams:
            break

    def score(hyp):
        tokens, cum = hyp
        return cum / ((len(prompt) + len(tokens) - (tokens[-1] in eos)) ** length_penalty)

    return sorted(done + beams, key=score, reverse=True)[:width]


def assert_same_beams(model, prompt, got, want):
    assert len(got) == len(want)
    for (tokens, cum), (want_tokens, want_cum) in zip(got, want):
        assert cum == pytest.approx(cum_logprob(model, prompt, tokens), abs=LOGPROB_ATOL)
        if tokens != want_tokens:  # only a tie may swap two beams
            assert cum_logprob(model, prompt, tokens) == pytest.approx(want_cum, abs=TIE), (tokens, want_tokens)


PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.model
@pytest.mark.slow
def test_beams_equal_transformers_generate_with_eos_out_of_reach(peers):
    engine, model, tokenizer = peers
    width = 3
    for text in PROMPTS[:2]:
        prompt = tokenizer.encode(text)
        got = ours(engine, prompt, n=width, max_tokens=8, min_tokens=8)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                num_beams=width,
                num_return_sequences=width,
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                length_penalty=1.0,
                early_stopping=False,
                pad_token_id=tokenizer.eos_token_ids[0],
                eos_token_id=list(tokenizer.eos_token_ids),
            )
        want = [(tuple(seq[len(prompt) :].tolist()),) for seq in out]
        want = [(tokens, cum_logprob(model, prompt, tokens)) for (tokens,) in want]
        assert_same_beams(model, prompt, got, want)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(
    "settings", [dict(n=3, max_tokens=16), dict(n=2, max_tokens=16, length_penalty=0.0, early_stopping=True)]
)
def test_beams_equal_vllms_beam_search_with_eos(peers, settings):
    engine, model, tokenizer = peers
    eos = set(tokenizer.eos_token_ids)
    prompt = tokenizer.encode(PROMPTS[2])
    got = ours(engine, prompt, **settings)
    want = vllm_beam_search(
        model,
        prompt,
        settings["n"],
        settings["max_tokens"],
        eos,
        settings.get("length_penalty", 1.0),
        settings.get("early_stopping", False),
    )
    assert any(tokens[-1] in eos for tokens, _ in want), "the case is meant to finish beams with EOS"
    assert_same_beams(model, prompt, got, want)
