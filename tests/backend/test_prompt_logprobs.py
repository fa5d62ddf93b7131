"""Prompt logprobs in the engine: every prompt token scored, through chunked prefill, past the prefix
cache, across preemption, shared by n > 1 siblings, on step 0 of each sequence only.

The reference is transformers' model holding the same tiny random weights, run on the whole prompt.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.hf_peer import build_hf_model
from protocol import PromptLogprobs, SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants, run_to_completion, tiny_checkpoint, tiny_engine

PROMPT = (
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the deep green forest "
    "where nobody can find it again until the next morning."
)


@pytest.fixture(scope="module")
def hf_tiny():
    ckpt = tiny_checkpoint()
    return build_hf_model(ckpt.config, ckpt.state_dict, attn_implementation="eager")


def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax at positions 0..P-2: (P-1, vocab)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()  # (P, V)
    return logits[:-1].log_softmax(-1)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[tuple[str, int], list[StepOutput]]:
    for request_id, (ids, params) in requests.items():
        engine.add_request(engine.make_request(request_id, ids, params))
    outputs = run_to_completion(engine)
    return check_stream_invariants(outputs, {r: p.n for r, (_, p) in requests.items()})


def assert_matches_hf(pl: PromptLogprobs, ids: list[int], reference: torch.Tensor, k: int) -> None:
    assert pl.token_ids == tuple(ids)
    assert len(pl.logprobs) == len(pl.ranks) == len(pl.top_token_ids) == len(ids) - 1
    expected = reference.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(pl.logprobs), expected, atol=1e-4)
    ranks = (reference > expected[:, None]).sum(1) + 1
    close = (reference - expected[:, None]).abs() < 1e-4  # near-ties may rank either way
    for i, rank in enumerate(pl.ranks):
        assert ranks[i] <= rank <= ranks[i] + close[i].sum() - 1
        assert len(pl.top_token_ids[i]) == len(pl.top_logprobs[i]) == len(pl.top_token_texts[i]) == k
        assert torch.allclose(torch.tensor(pl.top_logprobs[i]), reference[i].topk(k).values, atol=1e-4)
        if rank == 1 and k:  # the same arithmetic: exactly equal, as lm-eval's is_greedy compares them
            assert pl.top_logprobs[i][0] == pl.logprobs[i]


def test_chunked_prompt_logprobs_match_hf(hf_tiny):
    engine = tiny_engine(max_num_batched_tokens=16)  # the prompt is scored over several chunks
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 16
    seqs = run(engine, {"a": (ids, SamplingParams(max_tokens=3, prompt_logprobs=5, temperature=0))})
    messages = seqs[("a", 0)]
    pl = messages[0].prompt_logprobs
    assert pl is not None and all(m.prompt_logprobs is None for m in messages[1:])
    assert_matches_hf(pl, ids, hf_prompt_logprobs(hf_tiny, ids), 5)
    assert "".join(pl.token_texts) == engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert pl.top_token_texts[0] == tuple(engine.tokenizer.token_text(t) for t in pl.top_token_ids[0])


def test_prefix_cache_is_not_read_for_scored_prompts(hf_tiny):
    engine = tiny_engine()
    ids = engine.tokenizer.encode(PROMPT)
    run(engine, {"warm": (ids, SamplingParams(max_tokens=2))})
    hits = engine.stats().prefix_cache_hits
    seqs = run(engine, {"scored": (ids, SamplingParams(max_tokens=2, prompt_logprobs=0))})
    assert engine.stats().prefix_cache_hits == hits  # every position computed again
    pl = seqs[("scored", 0)][0].prompt_logprobs
    assert_matches_hf(pl, ids, hf_prompt_logprobs(hf_tiny, ids), 0)
    run(engine, {"again": (ids, SamplingParams(max_tokens=2))})
    assert engine.stats().prefix_cache_hits > hits  # and what it computed went into the cache


def test_siblings_share_the_prompt_logprobs_on_their_first_step():
    engine = tiny_engine()
    ids = engine.tokenizer.encode(PROMPT)
    seqs = run(engine, {"n3": (ids, SamplingParams(n=3, max_tokens=4, prompt_logprobs=2, seed=1))})
    firsts = [seqs[("n3", i)][0].prompt_logprobs for i in range(3)]
    assert firsts[0] is not None and firsts[0] == firsts[1] == firsts[2]
    assert all(m.prompt_logprobs is None for i in range(3) for m in seqs[("n3", i)][1:])


def test_preempted_while_prefilling_scores_the_same(hf_tiny):
    # A 16-block pool: "a" has filled most of it when "b" arrives, so b is preempted mid-prompt
    # (it arrived last) and scores its prompt again once a has finished.
    engine = tiny_engine(num_kv_blocks=16, max_num_batched_tokens=16, block_size=8)
    ids_a = engine.tokenizer.encode(PROMPT)
    ids_b = engine.tokenizer.encode(PROMPT.upper())
    engine.add_request(engine.make_request("a", ids_a, SamplingParams(max_tokens=90, temperature=0, ignore_eos=True)))
    outputs = [out for _ in range(60) for out in engine.step()]
    params = SamplingParams(max_tokens=128 - len(ids_b), prompt_logprobs=1, temperature=0, ignore_eos=True)
    engine.add_request(engine.make_request("b", ids_b, params))
    outputs += run_to_completion(engine)
    seqs = check_stream_invariants(outputs, {"a": 1, "b": 1})
    assert engine.stats().num_preemptions > 0
    assert_matches_hf(seqs[("b", 0)][0].prompt_logprobs, ids_b, hf_prompt_logprobs(hf_tiny, ids_b), 1)


def test_one_token_prompt_and_requests_without_prompt_logprobs():
    engine = tiny_engine()
    seqs = run(
        engine,
        {
            "one": ([42], SamplingParams(max_tokens=2, prompt_logprobs=3)),
            "off": ([42, 43], SamplingParams(max_tokens=2)),
        },
    )
    pl = seqs[("one", 0)][0].prompt_logprobs
    assert pl == PromptLogprobs((42,), (engine.tokenizer.token_text(42),), (), (), (), (), ())
    assert all(m.prompt_logprobs is None for m in seqs[("off", 0)])


def test_prompt_logprobs_is_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": True})
    assert SamplingParams.from_dict(SamplingParams(prompt_logprobs=4).to_dict()).prompt_logprobs == 4
