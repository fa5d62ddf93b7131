"""Beam search (backend/beam_search.py): the ranking on hand-made candidates, then the engine's beams
(forks, copy-on-write, preemption, aborts, neighbours) on the tiny model; against transformers on the
real weights in test_beam_search_hf.py."""

from __future__ import annotations

import pytest

from backend.beam_search import BeamSearch
from backend.sampler import SampledToken
from backend.sequence import Sequence
from protocol import FinishReason, InvalidRequestError, SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants, run_to_completion, smollm2_tokenizer, tiny_engine

EOS = 2  # stands for the model's EOS in the hand-made searches
PROMPT = (10, 11, 12)


def make_search(**params) -> tuple[BeamSearch, list[Sequence]]:
    p = SamplingParams(use_beam_search=True, **params)
    seqs = [Sequence(i, "r", i, PROMPT, p, arrival=0) for i in range(p.n)]
    return BeamSearch("r", seqs, smollm2_tokenizer(), frozenset({EOS}), max_model_len=64), seqs


def row(*pairs: tuple[int, float]) -> SampledToken:
    """A sampled row whose candidates are (token, logprob) pairs, most likely first."""
    return SampledToken(pairs[0][0], pairs[0][1], tuple(t for t, _ in pairs), tuple(lp for _, lp in pairs))


def apply(step, seqs: list[Sequence]) -> None:
    """What the engine does with a step: moved beams take their parent's tokens, then each gets its token."""
    before = {s.seq_id: list(s.output_token_ids) for s in seqs}
    for choice in step.choices:
        if choice.moves:
            choice.seq.output_token_ids = list(before[choice.parent.seq_id])
        choice.seq.append_token(choice.token.token_id)


def test_first_step_keeps_the_n_best_tokens_of_the_leader_without_moving_anything():
    search, seqs = make_search(n=2, max_tokens=4)
    step = search.advance({s: row((5, -0.1), (6, -0.5), (7, -1.0), (8, -2.0)) for s in seqs})
    assert [(c.seq.seq_index, c.token.token_id, c.moves) for c in step.choices] == [(0, 5, False), (1, 6, False)]
    assert step.dropped == () and step.outputs == ()


def test_a_beam_with_two_extensions_moves_one_into_the_sequence_whose_beam_has_none():
    search, seqs = make_search(n=2, max_tokens=4, logprobs=0)
    apply(search.advance({s: row((5, -0.1), (6, -0.2), (7, -3.0), (8, -4.0)) for s in seqs}), seqs)
    # beam 0 (5): its two continuations beat beam 1's (6) best
    step = search.advance(
        {
            seqs[0]: row((20, -0.1), (21, -0.2), (22, -5), (23, -6)),
            seqs[1]: row((30, -1.0), (31, -2), (32, -3), (33, -4)),
        }
    )
    assert [(c.seq.seq_index, c.parent.seq_index, c.token.token_id, c.moves) for c in step.choices] == [
        (0, 0, 20, False),
        (1, 0, 21, True),
    ]
    apply(step, seqs)
    assert [s.output_token_ids for s in seqs] == [[5, 20], [5, 21]]
    step = search.advance(
        {seqs[0]: row((40, -0.1), (41, -9), (42, -9), (43, -9)), seqs[1]: row((50, -0.3), (51, -9), (52, -9), (53, -9))}
    )
    apply(step, seqs)
    step = search.advance(
        {seqs[0]: row((60, -0.1), (61, -9), (62, -9), (63, -9)), seqs[1]: row((70, -0.1), (71, -9), (72, -9), (73, -9))}
    )
    assert step.choices == () and set(step.dropped) == set(seqs)  # max_tokens: ended
    assert [(o.seq_index, o.token_ids, o.finish_reason) for o in step.outputs] == [
        (0, (5, 20, 40, 60), FinishReason.LENGTH),
        (1, (5, 21, 50, 70), FinishReason.LENGTH),
    ]
    assert sum(step.outputs[0].logprobs.logprobs) == pytest.approx(-0.1 - 0.1 - 0.1 - 0.1)
    assert [o.request_finished for o in step.outputs] == [False, True]
    assert all(o.timings is not None and min(o.timings.queued_s, o.timings.decode_s) >= 0 for o in step.outputs)
    assert all(o.step == 0 and o.num_output_tokens == 4 for o in step.outputs)


def test_eos_finishes_a_hypothesis_and_length_penalty_ranks_the_outputs():
    # EOS after one token: -0.6 over (3 prompt + 1) tokens; the long beam: -1.0 over 3 + 4 tokens.
    for penalty, first in ((1.0, (5, 6, 7, 8)), (0.0, (5, EOS))):
        search, seqs = make_search(n=2, max_tokens=4, length_penalty=penalty)
        apply(search.advance({s: row((5, -0.1), (9, -3.0), (10, -3.1), (11, -3.2)) for s in seqs}), seqs)
        rows = {
            seqs[0]: row((6, -0.3), (EOS, -0.5), (12, -4), (13, -4)),
            seqs[1]: row((14, -5), (15, -5), (16, -5), (17, -5)),
        }
        apply(step := search.advance(rows), seqs)
        assert all(c.token.token_id != EOS for c in step.choices)  # an EOS extension is no beam
        apply(search.advance({s: row((7, -0.3), (18, -9), (19, -9), (20, -9)) for s in seqs}), seqs)
        end = search.advance({s: row((8, -0.3), (21, -9), (22, -9), (23, -9)) for s in seqs})
        assert end.outputs[0].token_ids == first
        assert end.outputs[0].finish_reason is (FinishReason.LENGTH if penalty else FinishReason.STOP)


def test_min_tokens_keeps_eos_from_ending_a_beam_and_stop_token_ids_end_one():
    search, seqs = make_search(n=1, max_tokens=3, min_tokens=2, stop_token_ids=(9,))
    apply(search.advance({s: row((EOS, -0.1), (5, -0.2)) for s in seqs}), seqs)  # EOS too early: no hypothesis
    assert seqs[0].output_token_ids == [5]
    apply(search.advance({seqs[0]: row((9, -0.1), (6, -0.2))}), seqs)  # 9 ends a hypothesis, 6 goes on
    assert seqs[0].output_token_ids == [5, 6]
    best = search.advance({seqs[0]: row((7, -5.0), (8, -6.0))}).outputs[0]
    assert (best.token_ids, best.finish_reason, best.stop_reason) == ((5, 9), FinishReason.STOP, 9)


def test_early_stopping_ends_the_search_once_n_hypotheses_finished():
    search, seqs = make_search(n=2, max_tokens=10, early_stopping=True)
    apply(search.advance({s: row((5, -0.1), (6, -0.2), (7, -1), (8, -1)) for s in seqs}), seqs)
    step = search.advance({s: row((EOS, -0.1), (9, -0.2), (10, -1), (11, -1)) for s in seqs})
    assert step.choices == () and len(step.outputs) == 2
    assert all(o.finish_reason is FinishReason.STOP and o.token_ids[-1] == EOS for o in step.outputs)


def test_no_step_while_a_beam_is_missing():
    search, seqs = make_search(n=2, max_tokens=4)
    apply(search.advance({s: row((5, -0.1), (6, -0.2), (7, -1), (8, -1)) for s in seqs}), seqs)
    assert search.advance({seqs[0]: row((9, -0.1), (10, -1), (11, -1), (12, -1))}) is None


def test_sampling_params_refuse_what_beam_search_cannot_honour():
    for field, value in (
        ("stop", ("x",)),
        ("logit_bias", ((1, 1.0),)),
        ("presence_penalty", 0.5),
        ("prompt_logprobs", 1),
    ):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(use_beam_search=True, **{field: value})
        assert e.value.param == field
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(use_beam_search=True, n=11)
    assert e.value.param == "n"
    params = SamplingParams(use_beam_search=True, n=3, length_penalty=0.5, early_stopping=True, logprobs=2)
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert params.num_top_logprobs == 6
    assert "use_beam_search" not in SamplingParams().to_dict()


# ---------------------------------------------------------------------------------------- engine


def beams(engine, prompt, request_id="b", **params) -> list[StepOutput]:
    engine.add_request(engine.make_request(request_id, list(prompt), SamplingParams(use_beam_search=True, **params)))
    outs = run_to_completion(engine)
    check_stream_invariants(outs, {request_id: params.get("n", 1)})
    return sorted((o for o in outs if o.request_id == request_id), key=lambda o: o.seq_index)


def result(outs: list[StepOutput]) -> list[tuple]:
    return [(o.token_ids, o.finish_reason, o.logprobs.logprobs if o.logprobs else None) for o in outs]


PROMPT_IDS = list(range(100, 120))


def test_one_beam_is_greedy_decoding():
    engine = tiny_engine(head_dim=32)
    one = beams(engine, PROMPT_IDS, n=1, max_tokens=12, ignore_eos=True)
    engine.add_request(
        engine.make_request("g", PROMPT_IDS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    )
    greedy = [o for o in run_to_completion(engine) if o.request_id == "g"]
    assert one[0].token_ids == tuple(t for o in greedy for t in o.token_ids)


def test_beams_are_the_same_alone_beside_others_chunked_and_preempted_and_free_every_block():
    params = SamplingParams(use_beam_search=True, n=3, max_tokens=14, ignore_eos=True, logprobs=1)
    neighbours = {f"n{i}": list(range(200 + 7 * i, 230 + 7 * i)) for i in range(3)}
    sampled = SamplingParams(max_tokens=40, seed=7, ignore_eos=True)

    def run(engine, beam: bool, others: bool) -> list[StepOutput]:
        for rid, prompt in neighbours.items() if others else ():
            engine.add_request(engine.make_request(rid, prompt, sampled))
        if beam:
            engine.add_request(engine.make_request("b", PROMPT_IDS, params))
        outs = run_to_completion(engine)
        check_stream_invariants(outs, {**({"b": 3} if beam else {}), **{rid: 1 for rid in neighbours if others}})
        return outs

    solo = tiny_engine(head_dim=32)
    alone = result(sorted(run(solo, beam=True, others=False), key=lambda o: o.seq_index))
    assert len({toks for toks, _, _ in alone}) == 3  # three different beams
    without_beams = run(solo, beam=False, others=True)

    # together, prefilling in small chunks, in a pool too small for all: beams are preempted and wait
    engine = tiny_engine(head_dim=32, num_kv_blocks=20, max_num_batched_tokens=16)
    outs = run(engine, beam=True, others=True)
    assert engine.stats().num_preemptions > 0
    assert result(sorted((o for o in outs if o.request_id == "b"), key=lambda o: o.seq_index)) == alone
    for rid in neighbours:
        assert [o.token_ids for o in outs if o.request_id == rid] == [
            o.token_ids for o in without_beams if o.request_id == rid
        ]
    engine.block_manager.check_invariants()
    assert engine.block_manager.stats().used == 0


def test_an_abort_mid_search_ends_every_output_and_frees_every_block():
    engine = tiny_engine(head_dim=32)
    engine.add_request(engine.make_request("b", PROMPT_IDS, SamplingParams(use_beam_search=True, n=3, max_tokens=30)))
    for _ in range(6):
        assert engine.step() == []
    engine.abort_request("b")
    outs = run_to_completion(engine)
    assert [(o.seq_index, o.finish_reason) for o in outs] == [(i, FinishReason.ABORT) for i in range(3)]
    assert outs[-1].request_finished
    assert engine.block_manager.stats().used == 0


def test_a_search_that_could_not_fit_the_pool_is_refused():
    engine = tiny_engine(head_dim=32, num_kv_blocks=20)  # 160 slots
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("b", PROMPT_IDS, SamplingParams(use_beam_search=True, n=4, max_tokens=30))
    assert e.value.param == "max_tokens" and "160" in e.value.message


def test_a_stop_token_adds_no_text_unless_asked_and_the_token_texts_join_to_the_text():
    tokenizer = smollm2_tokenizer()
    hello, world = tokenizer.encode("hello world", add_special_tokens=False)[:2]
    for include in (False, True):
        search, seqs = make_search(
            n=1, max_tokens=4, logprobs=0, include_stop_str_in_output=include, skip_special_tokens=not include
        )
        apply(search.advance({s: row((hello, -0.1), (7, -5)) for s in seqs}), seqs)
        apply(search.advance({seqs[0]: row((world, -0.1), (7, -5))}), seqs)
        apply(search.advance({seqs[0]: row((EOS, -0.1), (7, -5))}), seqs)  # EOS ends a hypothesis, 7 goes on
        out = search.advance({seqs[0]: row((8, -9.0), (9, -9.5))}).outputs[0]
        eos_text = tokenizer.token_text(EOS) if include else ""
        assert out.token_ids == (hello, world, EOS) and out.finish_reason is FinishReason.STOP
        assert out.text_delta == tokenizer.decode([hello, world]) + eos_text
        assert len(out.logprobs.token_texts) == 3
        assert "".join(out.logprobs.token_texts[:2]) == tokenizer.decode([hello, world])
