"""The engine end to end in-process (tiny random model, real tokenizer, scheduler, KV cache, sampler)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import FinishReason, InvalidRequestError, RequestFailure, SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants, run_to_completion, tiny_engine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


def generate(engine, prompt=PROMPT, request_id="r", **params):
    engine.add_request(engine.make_request(request_id, prompt, SamplingParams.from_dict(params)))
    outputs = run_to_completion(engine)
    return check_stream_invariants(outputs, {request_id: params.get("n", 1)})


def tokens(msgs: list[StepOutput]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_n4_finishing_in_the_same_step_each_keep_their_last_tokens(engine, max_tokens):
    per_seq = generate(engine, n=4, max_tokens=max_tokens, temperature=1.0, seed=3, ignore_eos=True, logprobs=0)
    assert sorted(i for _, i in per_seq) == [0, 1, 2, 3]
    last_messages = []
    for msgs in per_seq.values():
        assert len(tokens(msgs)) == max_tokens
        assert msgs[-1].finish_reason is FinishReason.LENGTH
        assert [len(m.token_ids) for m in msgs] == [1] * max_tokens
        last_messages.append(msgs[-1])
    assert sum(m.request_finished for m in last_messages) == 1
    assert engine.block_manager.stats().used == 0


def test_text_deltas_join_to_the_decoded_tokens(engine):
    per_seq = generate(engine, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)
    (msgs,) = per_seq.values()
    text = "".join(m.text_delta for m in msgs)
    assert text == engine.tokenizer.decode(tokens(msgs))
    assert "".join(t for m in msgs for t in m.logprobs.token_texts) == text
    for m in msgs:
        assert all(len(row) == 2 for row in m.logprobs.top_token_ids)


def test_seeded_sampling_is_reproducible_and_siblings_differ(engine):
    a = generate(engine, request_id="a", n=2, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    b = generate(engine, request_id="b", n=2, max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    assert tokens(a[("a", 0)]) == tokens(b[("b", 0)]) and tokens(a[("a", 1)]) == tokens(b[("b", 1)])
    assert tokens(a[("a", 0)]) != tokens(a[("a", 1)])


def test_eos_is_counted_with_empty_text_and_min_tokens_defers_it(engine):
    eos = engine.tokenizer.eos_token_ids[0]
    (msgs,) = generate(engine, max_tokens=5, logit_bias={eos: 100.0}, logprobs=0).values()
    assert tokens(msgs) == [eos] and msgs[-1].text_delta == "" and msgs[-1].finish_reason is FinishReason.STOP
    assert msgs[-1].logprobs.token_texts == ("",) and msgs[-1].num_output_tokens == 1
    (msgs,) = generate(engine, max_tokens=9, min_tokens=3, logit_bias={eos: 100.0}).values()
    assert len(tokens(msgs)) == 4 and tokens(msgs)[-1] == eos and msgs[-1].finish_reason is FinishReason.STOP


def test_stop_token_id_reports_its_id(engine):
    (msgs,) = generate(engine, max_tokens=6, logit_bias={42: 100.0}, stop_token_ids=[42]).values()
    assert tokens(msgs) == [42] and msgs[-1].stop_reason == 42 and msgs[-1].finish_reason is FinishReason.STOP


def test_allowed_token_ids_restrict_every_sequence(engine):
    allowed = [42, 43, 44]
    per_seq = generate(engine, n=3, max_tokens=6, allowed_token_ids=allowed, temperature=1.0, seed=1, ignore_eos=True)
    assert len(per_seq) == 3
    for msgs in per_seq.values():
        assert len(tokens(msgs)) == 6 and set(tokens(msgs)) <= set(allowed)
    params = SamplingParams.from_dict({"allowed_token_ids": allowed})
    assert params.allowed_token_ids == (42, 43, 44) and SamplingParams.from_dict(params.to_dict()) == params
    assert "allowed_token_ids" not in SamplingParams().to_dict()  # absent means any token
    for bad in ([], [-1], [1.5], "12"):
        with pytest.raises(InvalidRequestError) as refused:
            SamplingParams.from_dict({"allowed_token_ids": bad})
        assert refused.value.param == "allowed_token_ids"


def test_bad_words_are_never_generated(engine):
    # A token pushed far above the others, then banned as a word: every sequence avoids it.
    word = next(
        t
        for t in range(300, 2000)
        if engine.tokenizer.encode(engine.tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    text = engine.tokenizer.decode([word])
    pushed = {"logit_bias": {word: 100.0}, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    (msgs,) = generate(engine, **pushed).values()
    assert tokens(msgs) == [word] * 4
    for msgs in generate(engine, n=2, seed=5, bad_words=[text], **{**pushed, "temperature": 1.0}).values():
        assert len(tokens(msgs)) == 4 and word not in tokens(msgs)
    request = engine.make_request("bw", PROMPT, SamplingParams(bad_words=(text,)))
    assert (word,) in request.bad_words_token_ids
    params = SamplingParams.from_dict({"bad_words": [text]})
    assert params.bad_words == (text,) and SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_dict({"bad_words": ["  "]})
    assert refused.value.param == "bad_words"


def test_the_token_that_stops_a_sequence_adds_no_text_unless_asked(engine):
    """vLLM's rule: an EOS or a stop_token_ids token ends the sequence without its text, unless
    include_stop_str_in_output; its logprob entry keeps its text."""
    eos = engine.tokenizer.eos_token_ids[0]
    word = next(t for t in range(300, 2000) if engine.tokenizer.decode([t]).strip())
    word_text = engine.tokenizer.decode([word])
    eos_text = engine.tokenizer.decode([eos], skip_special_tokens=False)
    base = {"max_tokens": 5, "logprobs": 0, "temperature": 0}
    cases = [
        ({"logit_bias": {word: 100.0}, "stop_token_ids": [word]}, word, word_text),
        ({"logit_bias": {eos: 100.0}, "skip_special_tokens": False}, eos, eos_text),
    ]
    for extra, token, token_text in cases:
        for include in (False, True):
            (msgs,) = generate(engine, **base, **extra, include_stop_str_in_output=include).values()
            assert tokens(msgs) == [token] and msgs[-1].finish_reason is FinishReason.STOP
            assert msgs[-1].text_delta == (token_text if include else "")
            assert msgs[-1].logprobs.token_texts == (token_text,)


def test_context_limits():
    engine = tiny_engine(max_model_len=32)
    with pytest.raises(InvalidRequestError, match="context") as refused:
        engine.make_request("long", list(range(100, 132)), SamplingParams())
    assert (refused.value.param, refused.value.code) == ("prompt", "context_length_exceeded")
    with pytest.raises(InvalidRequestError, match=r"13 > 32 - 20") as refused:
        engine.make_request("greedy", list(range(100, 120)), SamplingParams(max_tokens=13))
    assert (refused.value.param, refused.value.code) == ("max_tokens", "context_length_exceeded")
    engine.make_request("fits", list(range(100, 120)), SamplingParams(max_tokens=12))
    (msgs,) = generate(engine, prompt=list(range(100, 120)), max_tokens=None, ignore_eos=True).values()
    assert msgs[-1].finish_reason is FinishReason.LENGTH and msgs[-1].num_prompt_tokens + len(tokens(msgs)) == 32


def test_out_of_vocabulary_token_ids_name_the_id_the_vocabulary_and_the_field(engine):
    vocab = engine.runtime.vocab_size
    for field_name, params in [
        ("stop_token_ids", SamplingParams(stop_token_ids=(5, vocab + 7))),
        ("logit_bias", SamplingParams(logit_bias=((vocab + 7, 1.0),))),
        ("allowed_token_ids", SamplingParams(allowed_token_ids=(3, vocab + 7))),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            engine.make_request("oov", PROMPT, params)
        assert refused.value.param == field_name
        assert str(vocab + 7) in refused.value.message and str(vocab) in refused.value.message


def test_abort_frees_blocks_at_once_and_ends_every_sequence(engine):
    engine.add_request(engine.make_request("x", PROMPT, SamplingParams(n=3, max_tokens=50, ignore_eos=True)))
    first = engine.step() + engine.step()
    assert engine.block_manager.stats().used > 0
    engine.abort_request("x")
    assert engine.block_manager.stats().used == 0
    rest = run_to_completion(engine)
    per_seq = check_stream_invariants(first + rest, {"x": 3})
    assert all(msgs[-1].finish_reason is FinishReason.ABORT for msgs in per_seq.values())


def test_a_failed_step_fails_only_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    engine.add_request(engine.make_request("doomed", PROMPT, SamplingParams(max_tokens=4)))
    real = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    outputs = engine.step()
    assert [type(o) for o in outputs] == [RequestFailure] and "boom" in outputs[0].message
    assert engine.block_manager.stats().used == 0 and not engine.has_work()
    monkeypatch.setattr(engine.runner, "execute", real)
    (msgs,) = generate(engine, request_id="fine", max_tokens=3, ignore_eos=True).values()
    assert len(tokens(msgs)) == 3


def test_greedy_output_is_the_same_under_preemption_and_chunked_prefill():
    prompts = [list(range(200 + 7 * i, 230 + 7 * i)) for i in range(6)]

    def run(**config):
        engine = tiny_engine(**config)
        for i, p in enumerate(prompts):
            engine.add_request(
                engine.make_request(f"q{i}", p, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            )
        per_seq = check_stream_invariants(run_to_completion(engine), {f"q{i}": 1 for i in range(6)})
        return {k: tokens(v) for k, v in per_seq.items()}, engine

    roomy, _ = run(num_kv_blocks=128, max_num_batched_tokens=512)
    tight, engine = run(num_kv_blocks=14, max_num_batched_tokens=16, max_model_len=100)
    assert engine.scheduler.num_preemptions > 0
    assert tight == roomy


def test_a_prompt_sharing_whole_cached_blocks_reports_them_on_every_message():
    engine = tiny_engine()  # (block_size 8) its own, so no earlier test's blocks are cached
    shared = list(range(500, 540))  # 5 blocks
    params = {"max_tokens": 4, "ignore_eos": True}
    first = generate(engine, prompt=shared, request_id="first", **params)
    again = generate(engine, prompt=shared, request_id="again", n=2, **params)
    longer = generate(engine, prompt=shared[:24] + list(range(600, 610)), request_id="longer", **params)
    cached = {key: {m.num_cached_tokens for m in msgs} for key, msgs in (first | again | longer).items()}
    # All 5 blocks of `again` hit, but its last token is computed for logits: the last block is recomputed.
    assert cached == {("first", 0): {0}, ("again", 0): {32}, ("again", 1): {32}, ("longer", 0): {24}}


requests_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "n": st.integers(1, 3),
            "max_tokens": st.integers(1, 10),
            "prompt_len": st.integers(1, 40),
            "logprobs": st.sampled_from([None, 0, 2]),
            "stop": st.sampled_from([[], ["e"], [" the", "\n"]]),
            "abort_at": st.one_of(st.none(), st.integers(0, 12)),
            "arrive_at": st.integers(0, 6),
        }
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=requests_strategy, blocks=st.integers(12, 40), budget=st.integers(16, 64), prefix=st.booleans())
def test_random_requests_aborts_and_tiny_pools_keep_every_invariant(reqs, blocks, budget, prefix):
    engine = tiny_engine(
        num_kv_blocks=blocks, max_num_batched_tokens=budget, max_model_len=96, enable_prefix_caching=prefix
    )
    outputs, step = [], 0
    pending = dict(enumerate(reqs))
    while pending or engine.has_work():
        for i, r in list(pending.items()):
            if r["arrive_at"] <= step:
                prompt = [100 + (i * 31 + j * 7) % 500 for j in range(r["prompt_len"])]
                params = SamplingParams(
                    n=r["n"],
                    max_tokens=r["max_tokens"],
                    logprobs=r["logprobs"],
                    stop=tuple(r["stop"]),
                    temperature=0.9,
                    seed=i,
                )
                engine.add_request(engine.make_request(f"h{i}", prompt, params))
                del pending[i]
        for i, r in enumerate(reqs):
            if r["abort_at"] == step:
                engine.abort_request(f"h{i}")
        outputs.extend(engine.step())
        step += 1
        assert step < 2000
    per_seq = check_stream_invariants(outputs, {f"h{i}": r["n"] for i, r in enumerate(reqs)})
    for (request_id, _), msgs in per_seq.items():
        r = reqs[int(request_id[1:])]
        assert len(tokens(msgs)) <= r["max_tokens"]
        if msgs[-1].finish_reason is FinishReason.LENGTH:
            assert len(tokens(msgs)) == r["max_tokens"]
        for stop in r["stop"]:
            assert stop not in "".join(m.text_delta for m in msgs)
    engine.block_manager.check_invariants()
    assert engine.block_manager.stats().used == 0


def test_a_full_queue_refuses_new_requests_at_once():
    from protocol import EngineOverloaded

    engine = tiny_engine(max_num_seqs=2, max_waiting_seqs=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(2):  # free seats: these do not queue
        engine.add_request(engine.make_request(f"run{i}", [1, 2, 3], params))
    engine.step()  # both seated
    engine.add_request(engine.make_request("wait0", [1, 2, 3], SamplingParams(n=2, max_tokens=4)))
    engine.add_request(engine.make_request("wait1", [1, 2, 3], params))  # 3 waiting: the bound
    with pytest.raises(EngineOverloaded, match="overloaded"):
        engine.add_request(engine.make_request("wait2", [1, 2, 3], params))
    assert engine.stats().rejected_requests == 1 and engine.stats().num_waiting == 3
    outputs = run_to_completion(engine)  # what was admitted is served whole
    finished = {o.request_id for o in outputs if isinstance(o, StepOutput) and o.request_finished}
    assert finished == {"run0", "run1", "wait0", "wait1"}
    engine.add_request(engine.make_request("later", [1, 2, 3], params))  # room again


def test_a_batch_is_admitted_whole_when_all_of_it_fits():
    from protocol import AdmissionGroup, EngineOverloaded

    engine = tiny_engine(max_num_seqs=2, max_waiting_seqs=3)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    batch = AdmissionGroup("batch", 5)  # 5 prompts: 2 seats and 3 queued, exactly
    for i in range(5):
        engine.add_request(engine.make_request(f"batch-{i}", [1, 2, 3 + i], params), batch)
    with pytest.raises(EngineOverloaded):  # a lone request still meets the bound
        engine.add_request(engine.make_request("alone", [1, 2, 3], params))
    assert engine.stats().rejected_requests == 1 and engine.stats().num_waiting == 5
    outputs = run_to_completion(engine)
    finished = {o.request_id for o in outputs if isinstance(o, StepOutput) and o.request_finished}
    assert finished == {f"batch-{i}" for i in range(5)}


def test_a_batch_that_does_not_fit_is_refused_whole_and_never_overruns_the_queue():
    from protocol import AdmissionGroup, EngineOverloaded

    engine = tiny_engine(max_num_seqs=2, max_waiting_seqs=3)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request(engine.make_request("running", [1, 2, 3], params))
    engine.step()  # one seat taken: room for 1 seated + 3 queued
    batch = AdmissionGroup("batch", 5)
    for i in range(5):  # the first is judged for all five and refused; the others get the same refusal
        with pytest.raises(EngineOverloaded, match="overloaded"):
            engine.add_request(engine.make_request(f"batch-{i}", [1, 2, 3 + i], params), batch)
    assert engine.stats().num_waiting == 0 and engine.stats().rejected_requests == 5
    engine.add_request(engine.make_request("small", [1, 2, 3], params), AdmissionGroup("small", 1))
    assert engine.stats().num_waiting == 1  # the queue is free for others


def test_a_batch_that_could_never_fit_is_a_400_naming_the_prompt():
    from protocol import AdmissionGroup, EngineOverloaded, InvalidRequestError

    engine = tiny_engine(max_num_seqs=2, max_waiting_seqs=3)
    params = SamplingParams(max_tokens=3, ignore_eos=True, n=2)
    batch = AdmissionGroup("huge", 3)  # 3 prompts x n=2 = 6 sequences > 2 seats + 3 queued, even when idle
    for i in range(3):
        with pytest.raises(InvalidRequestError, match="needs 6 sequences") as refused:
            engine.add_request(engine.make_request(f"huge-{i}", [1, 2, 3], params), batch)
        assert refused.value.param == "prompt" and not isinstance(refused.value, EngineOverloaded)
    assert engine.stats().num_waiting == 0 and engine.stats().rejected_requests == 0


def test_a_sequence_cut_mid_character_gives_its_last_token_the_held_text():
    """Regression (found by the soak): the text flushed at the end was in the text, not in the logprob tokens."""
    engine = tiny_engine()
    partial = next(i for i in range(engine.tokenizer.vocab_size) if engine.tokenizer.token_text(i) == "\ufffd")
    params = SamplingParams(max_tokens=1, logprobs=0, logit_bias=((partial, 100.0),), temperature=0)
    engine.add_request(engine.make_request("cut", [1, 2, 3], params))
    [out] = [o for o in run_to_completion(engine) if isinstance(o, StepOutput)]
    assert out.text_delta == "\ufffd" and out.logprobs.token_texts == ("\ufffd",)
