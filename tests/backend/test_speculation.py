"""Speculative decoding changes no output: drafts, verification rows, acceptance, and the engine end to end.

The tiny random model rarely repeats itself, so the engine tests draft with an oracle: the tokens a run
without speculation produced, cut at random lengths and corrupted at random places, so that every path
(all accepted, a rejection at any place, drafts past a finish) runs. The n-gram proposer itself is tested
on token lists, and end to end on SmolLM2 (tests/e2e/test_speculation.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from backend.attention import AttentionMetadata, allocate_kv_caches
from backend.models import build_model
from backend.sequence import Sequence
from backend.speculation import NgramIndex, NgramSpeculator, SpeculationConfig
from protocol import FinishReason, SamplingParams, StructuredOutputs
from tests.engine_helpers import check_stream_invariants, run_to_completion, tiny_checkpoint, tiny_engine


def seq_of(tokens: list[int], params: SamplingParams | None = None, prompt_len: int | None = None) -> Sequence:
    n = len(tokens) if prompt_len is None else prompt_len
    seq = Sequence(0, "r", 0, tuple(tokens[:n]), params or SamplingParams(max_tokens=100), 0)
    for t in tokens[n:]:
        seq.append_token(t)
    return seq


# ---------------------------------------------------------------- the n-gram index


def test_the_latest_earlier_occurrence_of_the_longest_suffix_is_proposed():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    # suffix (1, 2, 3) occurred ending at 3 and at 7: the latest continues with 7, 5, ...
    assert index.propose(seq_of(tokens), 3) == (7, 5, 1)


def test_a_longer_match_wins_over_a_later_shorter_one():
    index = NgramIndex(1, 3)
    tokens = [4, 5, 6, 8, 0, 6, 9, 4, 5, 6]  # (4, 5, 6) -> 8; the later (6,) alone would give 9
    assert index.propose(seq_of(tokens), 2) == (8, 0)


def test_no_match_no_draft_and_the_suffix_never_matches_itself():
    index = NgramIndex(2, 3)
    assert index.propose(seq_of([1, 2, 3, 4]), 4) == ()
    assert index.propose(seq_of([7, 7]), 4) == ()  # the only (7, 7) is the suffix


def test_a_loop_continues_past_the_suffix():
    assert NgramIndex(1, 1).propose(seq_of([9, 1, 2, 1, 2, 1]), 5) == (2, 1, 2, 1, 2)


def test_the_index_grows_with_the_output():
    index = NgramIndex(2, 2)
    seq = seq_of([1, 2, 3], prompt_len=3)
    assert index.propose(seq, 4) == ()
    for t in (1, 2):
        seq.append_token(t)
    assert index.propose(seq, 4) == (3, 1, 2, 3)  # (1, 2) ended at 2, then 3 1 2 followed, and it repeats
    seq.append_token(3)
    assert index.propose(seq, 2) == (1, 2)


def test_drafts_stop_at_max_tokens_and_the_context():
    config = SpeculationConfig(num_speculative_tokens=8, ngram_min=1, ngram_max=2, row_cost=0.0)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    seq = seq_of(tokens, SamplingParams(max_tokens=5), prompt_len=8)  # 2 of 5 out: 2 more drafts, then 1 sampled
    assert NgramSpeculator(config, max_model_len=100).propose(seq, 1) == (3, 4)
    seq = seq_of(tokens, SamplingParams(max_tokens=None), prompt_len=8)
    assert NgramSpeculator(config, max_model_len=12).propose(seq, 1) == (3,)  # 10 tokens, context 12


def test_failing_drafts_stop_drafting_and_it_tries_again_later():
    config = SpeculationConfig(num_speculative_tokens=4, ngram_min=1, ngram_max=1, row_cost=0.5)
    speculator = NgramSpeculator(config, max_model_len=1000)
    seq = seq_of([1, 2, 1, 2, 1])
    assert len(speculator.propose(seq, 1)) >= 1
    for _ in range(10):
        speculator.judge(seq, 4, 0)
    assert speculator.propose(seq, 1) == ()
    tries = next(i for i in range(1, 500) if speculator.propose(seq, 1))
    assert tries > 5  # a while without drafting, then one more try
    for _ in range(10):
        speculator.judge(seq, 4, 4)
    assert len(speculator.propose(seq, 1)) == 4


def test_more_decoding_sequences_ration_drafts():
    config = SpeculationConfig(num_speculative_tokens=8, ngram_min=1, ngram_max=1, row_cost=0.5)
    speculator = NgramSpeculator(config, max_model_len=1000)
    seq = seq_of([5, 6] * 20)
    for _ in range(3):
        speculator.judge(seq, 4, 3)  # acceptance about 0.8
    alone, crowded = len(speculator.propose(seq, 1)), len(speculator.propose(seq, 16))
    assert alone > crowded


# ---------------------------------------------------------------- verification rows are decode rows


def test_a_rows_logits_do_not_depend_on_how_many_rows_its_sequence_has_in_the_step():
    """Positions P..P+k as k+1 single-row decode steps, and as one step of k+1 rows: the same bits; and a
    prompt in one chunk or in three: the same K/V and last logits."""
    ckpt = tiny_checkpoint(head_dim=32)
    model = build_model(ckpt.config)
    model.load_weights(ckpt.state_dict)
    model.eval()
    cfg, bs = ckpt.config, 8
    prompt = list(range(300, 323))
    follow = [41, 42, 43, 44, 45]  # k + 1 = 5 tokens after the prompt
    table = torch.arange(8, dtype=torch.int32)

    def step(kv, tokens, start, rows_as_decodes):
        n = len(tokens)
        positions = torch.arange(start, start + n)
        if rows_as_decodes:
            lens, qsl, nd = list(range(start + 1, start + n + 1)), list(range(n + 1)), n
        else:  # one prefill chunk
            lens, qsl, nd = [start + n], [0, n], 0
        meta = AttentionMetadata(
            slot_mapping=positions.clone(),  # table is the identity: slot == position
            num_decode_seqs=nd,
            block_tables=table.repeat(len(lens), 1),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            block_size=bs,
        )
        return model.compute_logits(model(torch.tensor(tokens), positions, kv, meta))  # (n, V)

    def fresh():
        kv = allocate_kv_caches(cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
        step(kv, prompt, 0, rows_as_decodes=False)
        return kv

    with torch.inference_mode():
        kv = fresh()
        one_by_one = torch.cat([step(kv, [t], len(prompt) + i, True) for i, t in enumerate(follow)])
        kv = fresh()
        together = step(kv, follow, len(prompt), True)
        # A prompt's rows are prefill rows however it is chunked (a lone last token too): the same K/V.
        whole = allocate_kv_caches(cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
        last_whole = step(whole, prompt, 0, rows_as_decodes=False)[-1]
        chunked = allocate_kv_caches(cfg.num_hidden_layers, 8, bs, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
        for a, b in ((0, 10), (10, 22), (22, 23)):
            last_chunked = step(chunked, prompt[a:b], a, rows_as_decodes=False)[-1]
    assert torch.equal(one_by_one, together)
    assert torch.equal(last_whole, last_chunked)
    assert all(torch.equal(x, y) for layer_a, layer_b in zip(whole, chunked) for x, y in zip(layer_a, layer_b))


# ---------------------------------------------------------------- the engine: the same outputs


def mixed_requests(count: int, seed: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.8, top_p=0.9, ignore_eos=True),
        dict(n=2, logprobs=3, temperature=0.7),
        dict(stop=("e", " a"), repetition_penalty=1.2, frequency_penalty=0.5, temperature=0.0),
        dict(temperature=1.0, min_tokens=5, structured_outputs=StructuredOutputs(regex="[a-z ]{3,40}")),
        dict(temperature=0.9, top_k=20, presence_penalty=0.7, logprobs=0),
        dict(temperature=0.0, structured_outputs=StructuredOutputs(json='{"type": "object"}'), max_tokens=20),
        dict(temperature=0.6, min_p=0.1, bad_words=("the",), stop_token_ids=(30,)),
        dict(temperature=0.8, top_p=0.9, prompt_logprobs=2, logprobs=1),
        dict(
            temperature=0.0,
            structured_outputs=StructuredOutputs(
                json='{"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}'
            ),
        ),
    ]
    reqs = []
    for i in range(count):
        kind = dict(kinds[i % len(kinds)])
        kind.setdefault("max_tokens", rng.randrange(6, 30))
        prompt = [rng.randrange(100, 3000) for _ in range(rng.randrange(2, 40))]
        reqs.append((f"r{i}", prompt, SamplingParams(seed=i, **kind)))
    return reqs


def new_engine(**settings):
    """A tiny engine on the C++ attention kernels (their rows do not depend on a prompt's chunking, as
    the torch references' do), whose grammars compile in time on a loaded machine."""
    return tiny_engine(head_dim=32, grammar_compile_timeout_s=120.0, **settings)


def outcome(engine, reqs, abort: dict[str, int] | None = None):
    """Each sequence's tokens, text, logprobs (top ones too), finish and stop reason."""
    outputs = []
    for request_id, prompt, params in reqs:
        engine.add_request(engine.make_request(request_id, prompt, params))
    if abort:
        for step in range(max(abort.values()) + 1):
            for request_id, at in abort.items():
                if at == step:
                    engine.abort_request(request_id)
            outputs += engine.step()
    outputs += run_to_completion(engine)
    per_seq = check_stream_invariants(outputs, {r: p.n for r, _, p in reqs})
    result = {}
    for key, msgs in per_seq.items():
        logprobs = [m.logprobs for m in msgs if m.logprobs is not None]
        result[key] = (
            [t for m in msgs for t in m.token_ids],
            "".join(m.text_delta for m in msgs),
            [x for lp in logprobs for x in lp.logprobs],
            [x for lp in logprobs for x in lp.top_logprobs],
            [x for lp in logprobs for x in lp.token_texts],
            msgs[-1].finish_reason,
            msgs[-1].stop_reason,
            msgs[-1].num_output_tokens,
            msgs[0].prompt_logprobs,
        )
    return result


def oracle(engine, truth: dict, seed: int, max_len: int = 6):
    """Drafts from the tokens a run without speculation produced: random lengths, some corrupted."""
    rng = random.Random(seed)

    def propose(seq, num_decoding):
        tokens = truth[(seq.request_id, seq.seq_index)][0]
        drafts = list(tokens[seq.num_output_tokens : seq.num_output_tokens + rng.randrange(0, max_len + 1)])
        if len(drafts) < max_len and rng.random() < 0.3:
            drafts.append(rng.randrange(100, 3000))  # past the end: drafted beyond the finish
        if drafts and rng.random() < 0.4:
            drafts[rng.randrange(len(drafts))] = rng.randrange(100, 3000)
        return tuple(drafts)

    engine.speculator.propose = propose


@pytest.mark.parametrize(
    "count, budget, blocks",
    [(40, 64, 256), (40, 20, 13), pytest.param(200, 64, 256, marks=pytest.mark.slow)],
)
def test_speculation_gives_the_same_tokens_logprobs_and_finishes(count, budget, blocks):
    reqs = mixed_requests(count)
    settings = dict(num_kv_blocks=blocks, max_num_batched_tokens=budget, max_model_len=96)
    plain = outcome(new_engine(**settings), reqs)
    engine = new_engine(speculative="ngram", **settings)
    oracle(engine, plain, seed=budget)
    speculated = outcome(engine, reqs)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # accepted and rejected drafts both ran
    assert speculated == plain
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == blocks
    if blocks == 13:
        assert stats.num_preemptions > 0  # drafts met preemption too


def test_aborts_mid_draft_free_every_block():
    reqs = mixed_requests(12, seed=3)
    plain = outcome(new_engine(num_kv_blocks=128), reqs)
    engine = new_engine(speculative="ngram", num_kv_blocks=128)
    oracle(engine, plain, seed=5)
    aborted = {f"r{i}": 2 + i for i in range(0, 12, 3)}
    speculated = outcome(engine, reqs, abort=aborted)
    engine.block_manager.check_invariants()
    assert engine.block_manager.num_free_blocks == 128
    for key, result in speculated.items():
        if key[0] in aborted:
            assert result[5] in (FinishReason.ABORT, *[plain[key][5]])
            assert result[0] == plain[key][0][: len(result[0])]  # a prefix of the plain run's tokens
        else:
            assert result == plain[key]


def test_prefix_cache_blocks_written_by_drafts_serve_later_requests_exactly():
    """A request whose prompt is an earlier speculated request's prompt and output hits its blocks."""
    first = [("a", list(range(200, 219)), SamplingParams(max_tokens=29, temperature=0.0, ignore_eos=True))]
    plain_engine = new_engine()
    plain = outcome(plain_engine, first)
    engine = new_engine(speculative="ngram")
    oracle(engine, plain, seed=7)
    assert outcome(engine, first) == plain
    follow = [("b", first[0][1] + plain[("a", 0)][0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    expected = outcome(plain_engine, follow)
    oracle(engine, plain | expected, seed=8)
    hit_before = engine.stats().prefix_cache_hits
    assert outcome(engine, follow) == expected
    assert engine.stats().prefix_cache_hits - hit_before >= 40  # 5 of its 6 full blocks came from "a"


def test_the_real_proposer_drafts_and_changes_nothing():
    """The tiny model's output repeats single tokens now and then: unigram lookup drafts after them."""
    prompt = [300, 301, 302, 303] * 6
    reqs = [(f"g{i}", prompt[i:], SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)) for i in range(3)]
    plain = outcome(new_engine(max_model_len=128), reqs)
    engine = new_engine(speculative="ngram", ngram_min=1, speculative_row_cost=0.0, max_model_len=128)
    assert outcome(engine, reqs) == plain
    assert engine.stats().spec_draft_tokens > 0
