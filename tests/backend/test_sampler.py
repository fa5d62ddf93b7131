"""Sampler: greedy, filters, penalties, min_tokens, seeds, raw logprobs; against dense references."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend import logits_processors
from backend import sampler as sampler_module
from backend.sampler import SampledToken, Sampler, SamplingRow, make_generator
from protocol import SamplingParams

EOS = 0


def row(params=None, generator=None, prompt=(5, 6), output=(), eos=(EOS,), **kw):
    params = params or SamplingParams(**kw)
    return SamplingRow(params, generator, tuple(prompt), tuple(output), tuple(eos))


def logits_for(seed, rows, vocab, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---------------------------------------------------------------- dense references (float64, vLLM's formulas)


def ref_processed(x: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """min_tokens mask, logit_bias, repetition / frequency / presence penalties on one row."""
    x = x.double().clone()
    p, V = r.params, x.numel()
    if len(r.output_token_ids) < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        for t in banned:
            if t < V:
                x[t] = -math.inf
    for t, b in p.logit_bias:
        if t < V:
            x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            if t < V:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(r.output_token_ids).items():
        if t < V:
            x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_kept(x: torch.Tensor, p: SamplingParams, min_p: float, top_p: float) -> set[int]:
    """Tokens with nonzero probability after temperature, min_p, top_k, top_p (sort-based top-p)."""
    probs = torch.softmax(x.double() / p.temperature, dim=-1)
    keep = probs > 0
    if min_p > 0:
        keep &= probs >= min_p * probs.max()
    V = x.numel()
    if 0 < p.top_k < V:
        keep &= probs >= probs.sort(descending=True).values[p.top_k - 1]
    if top_p < 1.0:
        q = probs * keep
        q = q / q.sum()
        order = q.argsort(descending=True)
        cum = q[order].cumsum(0)
        in_nucleus = torch.zeros(V, dtype=torch.bool)
        in_nucleus[order] = (cum - q[order]) < top_p
        keep &= in_nucleus
    return set(keep.nonzero().flatten().tolist())


def kept_by_sampler(x: torch.Tensor, params: list[SamplingParams]) -> list[set[int]]:
    weights = sampler_module._filtered_weights(x.clone(), params)
    return [set(w.nonzero().flatten().tolist()) for w in weights]


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_returns_plain_values():
    x = logits_for(0, 5, 100)
    out = Sampler().sample(x, [row(temperature=0.0) for _ in range(5)])
    assert [t.token_id for t in out] == x.argmax(-1).tolist()
    for t in out:
        assert isinstance(t, SampledToken) and type(t.token_id) is int
        assert t.logprob is None and t.top_token_ids == () and t.top_logprobs == ()


def test_tiny_temperature_is_greedy():
    x = logits_for(1, 3, 50)
    out = Sampler().sample(x, [row(temperature=1e-6, seed=1) for _ in range(3)])
    assert [t.token_id for t in out] == x.argmax(-1).tolist()


def test_mixed_batch_greedy_and_random_rows():
    x = logits_for(2, 6, 200)
    x[:, 7] += 50.0  # token 7 dominates every row
    rows = [row(temperature=0.0) if i % 2 else row(temperature=1.0, top_k=1) for i in range(6)]
    assert [t.token_id for t in Sampler().sample(x, rows)] == [7] * 6


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_whatever_the_processing():
    x = logits_for(3, 4, 300)
    params = SamplingParams(
        temperature=0.3,
        top_k=5,
        top_p=0.8,
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        logit_bias=((11, 30.0),),
        logprobs=5,
    )
    rows = [row(params, make_generator(3, i), output=(11, 12)) for i in range(4)]
    out = Sampler().sample(x, rows)
    raw = torch.log_softmax(x.double(), dim=-1)
    for i, t in enumerate(out):
        assert t.logprob == pytest.approx(raw[i, t.token_id].item(), abs=1e-5)
        top = raw[i].topk(5)
        assert t.top_token_ids == tuple(top.indices.tolist())
        assert t.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
        assert all(type(v) is float for v in t.top_logprobs) and type(t.logprob) is float


def test_logprobs_zero_gives_only_the_sampled_token_and_none_gives_nothing():
    x = logits_for(4, 3, 100)
    rows = [row(temperature=0.0, logprobs=0), row(temperature=0.0), row(temperature=0.0, logprobs=20)]
    out = Sampler().sample(x, rows)
    raw = torch.log_softmax(x, dim=-1)
    assert out[0].logprob == pytest.approx(raw[0].max().item(), abs=1e-6)
    assert out[0].top_token_ids == () and out[0].top_logprobs == ()
    assert out[1].logprob is None
    assert len(out[2].top_token_ids) == 20 and out[2].top_token_ids[0] == out[2].token_id


def test_logprob_of_a_token_outside_the_top_k():
    """The sampled token's entry is there even when it is not among the top alternatives."""
    x = torch.zeros(1, 10)
    x[0, :3] = 5.0
    out = Sampler().sample(x, [row(temperature=0.0, logit_bias=((9, 100.0),), logprobs=2)])
    assert out[0].token_id == 9
    assert out[0].logprob == pytest.approx(torch.log_softmax(x, -1)[0, 9].item(), abs=1e-6)
    assert 9 not in out[0].top_token_ids


# ---------------------------------------------------------------- processors


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    freq=st.sampled_from([0.0, -1.0, 0.7]),
    pres=st.sampled_from([0.0, 1.5, -0.5]),
    min_tokens=st.integers(0, 4),
    ignore_eos=st.booleans(),
    output=st.lists(st.integers(0, 70), max_size=8),
    prompt=st.lists(st.integers(0, 70), max_size=8),
    bias=st.dictionaries(st.integers(0, 70), st.floats(-100, 100), max_size=4),
)
def test_processors_match_reference(seed, rep, freq, pres, min_tokens, ignore_eos, output, prompt, bias):
    V = 64  # ids up to 70: some are past the vocabulary and must be ignored
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        min_tokens=min_tokens,
        max_tokens=None,
        ignore_eos=ignore_eos,
        stop_token_ids=(3, 65),
        logit_bias=tuple(sorted(bias.items())),
    )
    rows = [row(params, prompt=prompt, output=output, eos=(EOS, 1)), row(temperature=0.0, output=output)]
    x = logits_for(seed, 2, V)
    got = logits_processors.apply_logits_processors(x, rows)
    torch.testing.assert_close(got[0].double(), ref_processed(x[0], rows[0]), rtol=1e-5, atol=1e-4)
    assert torch.equal(got[1], x[1])  # a plain row is untouched
    assert torch.equal(x, logits_for(seed, 2, V))  # and the input is never modified


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.zeros(1, 10)
    x[0, EOS] = 10.0
    x[0, 4] = 9.0
    x[0, 2] = 8.0
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,))
    assert Sampler().sample(x, [row(p, output=())])[0].token_id == 2
    assert Sampler().sample(x, [row(p, output=(7,))])[0].token_id == 2
    assert Sampler().sample(x, [row(p, output=(7, 7))])[0].token_id == EOS
    # ignore_eos: EOS is an ordinary token, never masked; stop_token_ids still are
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(4,), ignore_eos=True)
    assert Sampler().sample(x, [row(p, output=())])[0].token_id == EOS
    x[0, EOS] = 0.0
    assert Sampler().sample(x, [row(p, output=())])[0].token_id == 2


def test_min_tokens_masks_sampled_rows_too():
    x = torch.zeros(64, 5)
    x[:, EOS] = 20.0
    rows = [row(temperature=1.0, min_tokens=1, seed=i, generator=make_generator(i, 0)) for i in range(64)]
    assert all(t.token_id != EOS for t in Sampler().sample(x, rows))


def test_logit_bias_steers_and_out_of_vocab_is_ignored():
    x = logits_for(5, 2, 30)
    rows = [row(temperature=0.0, logit_bias=((17, 100.0), (10_000, 100.0))), row(temperature=0.0)]
    out = Sampler().sample(x, rows)
    assert out[0].token_id == 17 and out[1].token_id == x[1].argmax().item()


def test_allowed_token_ids_keep_only_those_tokens():
    x = logits_for(6, 2, 50)
    allowed = (3, 17, 41)
    greedy = row(temperature=0.0, allowed_token_ids=allowed, logprobs=2)
    free = row(temperature=0.0)
    out = Sampler().sample(x, [greedy, free])
    assert out[0].token_id == max(allowed, key=lambda t: x[0, t].item())
    assert out[1].token_id == x[1].argmax().item()  # the other row of the batch is untouched
    raw = torch.log_softmax(x[0].double(), dim=-1)  # logprobs stay the model's raw distribution
    assert out[0].logprob == pytest.approx(raw[out[0].token_id].item(), abs=1e-5)
    assert out[0].top_token_ids == tuple(raw.topk(2).indices.tolist())
    rows = [row(temperature=1.5, allowed_token_ids=allowed, generator=make_generator(i, 0)) for i in range(64)]
    drawn = {t.token_id for t in Sampler().sample(logits_for(7, 64, 50), rows)}
    assert drawn <= set(allowed) and len(drawn) > 1


def test_allowed_token_ids_win_over_min_tokens_or_bad_words_when_they_banned_them_all():
    x = torch.zeros(1, 10)
    x[0, 5] = 9.0
    x[0, 3] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=(EOS, 3))
    assert Sampler().sample(x, [row(p, output=())])[0].token_id == 3  # EOS banned, 3 allowed
    p = SamplingParams(temperature=0.0, min_tokens=2, allowed_token_ids=(EOS,))
    assert Sampler().sample(x, [row(p, output=())])[0].token_id == EOS  # nothing else is allowed
    # bad_words banning every allowed token: the allowed set still wins (an all -inf row has no answer)
    p = SamplingParams(temperature=0.0, allowed_token_ids=(3,))
    banned = SamplingRow(p, None, (5, 6), (), (EOS,), bad_words_token_ids=((3,),))
    assert Sampler().sample(x, [banned])[0].token_id == 3
    p = SamplingParams(temperature=0.0, allowed_token_ids=(3, 7))
    banned = SamplingRow(p, None, (5, 6), (), (EOS,), bad_words_token_ids=((3,),))
    assert Sampler().sample(x, [banned])[0].token_id == 7  # one allowed token left: the ban holds


def test_repetition_penalty_discourages_seen_tokens():
    x = torch.tensor([[2.0, 1.9, -1.0, -1.05]])
    assert Sampler().sample(x, [row(temperature=0.0, repetition_penalty=1.2, prompt=(0,))])[0].token_id == 1
    # negative logits are multiplied: -1.0 * 1.2 < -1.05
    x = torch.tensor([[-1.0, -1.05]])
    assert Sampler().sample(x, [row(temperature=0.0, repetition_penalty=1.2, output=(0,), prompt=())])[0].token_id == 1


def test_frequency_and_presence_penalties_count_output_only():
    x = torch.tensor([[3.0, 2.0, 0.0]])
    # token 0 in the prompt: no frequency penalty
    assert Sampler().sample(x, [row(temperature=0.0, frequency_penalty=2.0, prompt=(0, 0, 0))])[0].token_id == 0
    # token 0 once in the output: 3 - 0.6 = 2.4 > 2; twice: 1.8 < 2
    assert Sampler().sample(x, [row(temperature=0.0, frequency_penalty=0.6, output=(0,))])[0].token_id == 0
    assert Sampler().sample(x, [row(temperature=0.0, frequency_penalty=0.6, output=(0, 0))])[0].token_id == 1
    assert Sampler().sample(x, [row(temperature=0.0, presence_penalty=1.5, output=(0, 0, 0))])[0].token_id == 1


# ---------------------------------------------------------------- filters


filter_params = st.builds(
    lambda t, p, k, m: SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m),
    t=st.sampled_from([0.05, 0.3, 0.7, 1.0, 1.5, 3.0]),
    p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.1, 0.001]),
    k=st.sampled_from([0, -1, 1, 2, 5, 40, 10_000]),
    m=st.sampled_from([0.0, 0.001, 0.05, 0.3]),
)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 400), params=st.lists(filter_params, min_size=1, max_size=4))
def test_filters_match_sort_based_reference(seed, vocab, params):
    """Kept tokens == the reference up to float rounding: strict reference ⊆ ours ⊆ loose reference."""
    x = logits_for(seed, len(params), vocab, scale=4.0)
    ours = kept_by_sampler(x, params)
    for i, p in enumerate(params):
        loose = ref_kept(x[i], p, p.min_p * (1 - 1e-4), min(1.0, p.top_p + 1e-4))
        strict = ref_kept(x[i], p, p.min_p * (1 + 1e-4), max(1e-6, p.top_p - 1e-4))
        # tokens float32 underflow drops (probability < 1e-30 of the top one) are nobody's concern
        probs = torch.softmax(x[i].double() / p.temperature, -1)
        strict = {t for t in strict if probs[t] >= 1e-30 * probs.max()}
        assert strict <= ours[i] <= loose
        assert x[i].argmax().item() in ours[i]  # the top token always survives


def test_top_p_nucleus_wider_than_the_candidate_stages():
    """A flat distribution whose nucleus has thousands of tokens (the full-sort fallback)."""
    x = logits_for(6, 3, 5000, scale=0.5)
    params = [SamplingParams(top_p=0.99), SamplingParams(top_p=0.3), SamplingParams(top_p=0.999, top_k=3000)]
    ours = kept_by_sampler(x, params)
    for i, p in enumerate(params):
        assert ref_kept(x[i], p, 0.0, p.top_p - 1e-4) <= ours[i] <= ref_kept(x[i], p, 0.0, min(1.0, p.top_p + 1e-4))
    assert len(ours[0]) > 1024


def test_sampled_tokens_stay_inside_the_filters():
    x = logits_for(7, 1, 300).repeat(400, 1)
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.7, seed=3)
    rows = [row(p, make_generator(3, i)) for i in range(400)]
    allowed = ref_kept(x[0], p, 0.0, 0.7 + 1e-4)
    drawn = [t.token_id for t in Sampler().sample(x, rows)]
    assert set(drawn) <= allowed and len(set(drawn)) > 1


def test_temperature_sampling_follows_softmax():
    V, N, T = 6, 30_000, 0.7
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    x = base.repeat(N, 1)
    torch.manual_seed(0)
    out = Sampler().sample(x, [row(temperature=T) for _ in range(N)])
    counts = Counter(t.token_id for t in out)
    expected = torch.softmax(base.double() / T, -1)
    for t in range(V):
        sigma = math.sqrt(N * expected[t] * (1 - expected[t]))
        assert abs(counts[t] - N * expected[t]) < 5 * sigma + 1, (t, counts[t], N * expected[t].item())


# ---------------------------------------------------------------- the draw


def test_inverse_cdf_edges_and_tiny_probabilities():
    V = 49152
    w = torch.zeros(3, V)
    w[:, 300] = 1.0  # the first block (tokens 0..255) weighs nothing
    w[:, 301] = 0.0
    w[:, V - 1] = 1e-9  # lost entirely by a flat float32 cumsum next to a mass of 1
    u = torch.tensor([0.0, 1.0 - 2.0**-53, 1.0 - 5e-10], dtype=torch.float64)
    assert sampler_module._inverse_cdf(w, u).tolist() == [300, V - 1, V - 1]
    u = torch.tensor([0.5, 1.0 - 2e-9, 0.999], dtype=torch.float64)
    assert sampler_module._inverse_cdf(w, u).tolist() == [300, 300, 300]
    # a vocabulary that is not a multiple of the block: padding never picked
    w = torch.zeros(2, 300)
    w[:, 299] = 1.0
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sampler_module._inverse_cdf(w, u).tolist() == [299, 299]


def test_inverse_cdf_never_picks_a_zero_weight_token():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(64, 1000, generator=g) * (torch.rand(64, 1000, generator=g) < 0.05)  # mostly zeros
    w[:, 999] = 0.0
    u = torch.rand(64, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53
    picked = sampler_module._inverse_cdf(w, u)
    assert (w.gather(1, picked[:, None]) > 0).all()


def test_seeded_row_is_the_same_whatever_the_batch():
    V = 500
    target = logits_for(8, 1, V)
    p = SamplingParams(temperature=1.2, top_p=0.95, seed=1234)

    def other_row(j):
        if j % 3 == 0:
            return row(temperature=0.0)
        if j % 3 == 1:
            return row(temperature=0.9, top_k=50, generator=make_generator(j, 0))
        return row(temperature=1.0, min_p=0.1)  # unseeded: torch's global RNG

    def run(position, num_others):
        gen = make_generator(1234, 0)
        tokens = []
        for step in range(20):
            others = logits_for(100 + step, num_others, V)
            x = torch.cat([others[:position], target, others[position:]])
            rows = [other_row(j) for j in range(num_others + 1)]
            rows[position] = row(p, gen)
            tokens.append(Sampler().sample(x, rows)[position].token_id)
        return tokens

    alone = run(0, 0)
    assert run(0, 7) == alone
    assert run(5, 7) == alone
    assert len(set(alone)) > 1


def test_generators_seeded_siblings_and_unseeded():
    def stream(g):
        return torch.rand(4, generator=g, dtype=torch.float64).tolist()

    assert stream(make_generator(42, 0)) == stream(make_generator(42, 0))
    assert stream(make_generator(42, 0)) != stream(make_generator(42, 1))
    assert stream(make_generator(42, 1)) != stream(make_generator(43, 0))
    assert stream(make_generator(-5, 0)) == stream(make_generator(-5, 0))
    assert stream(make_generator(2**100, 3)) == stream(make_generator(2**100, 3))
    assert stream(make_generator(None, 0)) != stream(make_generator(None, 0))


def test_same_seed_same_tokens_different_sibling_different_tokens():
    x = logits_for(9, 1, 1000, scale=1.0)
    p = SamplingParams(temperature=1.0, seed=7)

    def draw(seq_index):
        g = make_generator(7, seq_index)
        return [Sampler().sample(x, [row(p, g)])[0].token_id for _ in range(10)]

    assert draw(0) == draw(0)
    assert draw(0) != draw(1)


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [row(temperature=0.0)])
    assert Sampler().sample(torch.zeros(0, 5), []) == []


@pytest.mark.parametrize("fill", [math.nan, -math.inf])
def test_degenerate_logits_do_not_crash_the_batch(fill):
    """NaN or all -inf logits (a model bug) give some in-range token instead of an exception."""
    x = logits_for(10, 4, 300)
    x[1] = fill
    rows = [
        row(temperature=1.0, top_p=0.9),
        row(temperature=1.0, top_p=0.9, top_k=5, min_p=0.1),
        row(temperature=0.0),
        row(temperature=0.7),
    ]
    out = Sampler().sample(x, rows)
    assert all(0 <= t.token_id < 300 for t in out)


def test_a_sequences_fixed_processor_inputs_are_built_once_and_give_what_a_fresh_build_gives():
    p = SamplingParams(
        temperature=0.0,
        min_tokens=3,
        stop_token_ids=(4, 99),
        logit_bias=((7, 5.0), (60, 1.0)),
        allowed_token_ids=(7, 9),
    )
    fixed = logits_processors.FixedInputs(p, (EOS,))
    first = fixed.tensors(50, torch.device("cpu"))
    assert fixed.tensors(50, torch.device("cpu")) is first  # kept for the sequence's later steps
    assert first.min_tokens_banned.tolist() == [EOS, 4]  # 99 is past the vocabulary
    assert first.bias_ids.tolist() == [7] and first.bias_values.tolist() == [5.0]
    assert (~first.disallowed).nonzero().flatten().tolist() == [7, 9]
    x = logits_for(8, 3, 50)
    kept = [SamplingRow(p, None, (5, 6), (1,) * i, (EOS,), fixed=fixed) for i in range(3)]
    fresh = [SamplingRow(p, None, (5, 6), (1,) * i, (EOS,)) for i in range(3)]
    assert torch.equal(
        logits_processors.apply_logits_processors(x, kept), logits_processors.apply_logits_processors(x, fresh)
    )
