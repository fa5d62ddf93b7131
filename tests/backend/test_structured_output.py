"""Structured outputs in the engine: xgrammar masks, one matcher per sequence, compile cache, and the
engine's other mechanisms (preemption, n > 1, min_tokens, stop strings, abort) on constrained
sequences. The tiny random model (tests/engine_helpers.py) writes gibberish, so only the constraint
can make its output valid: every validity assertion here fails if enforcement breaks."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import jsonschema
import pytest
import torch

from backend.sampler import Sampler, SamplingRow
from backend.structured_output import TokenBitmask
from protocol import FinishReason, InvalidRequestError, SamplingParams, StructuredOutputs
from tests.engine_helpers import check_stream_invariants, run_to_completion, tiny_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(num_kv_blocks=128)


def run(engine, requests: dict[str, dict], prompt: str = "Hello there") -> dict[tuple[str, int], str]:
    for request_id, params in requests.items():
        engine.add_request(engine.make_request(request_id, prompt, SamplingParams.from_dict(params)))
    outputs = run_to_completion(engine)
    per_seq = check_stream_invariants(outputs, {r: p.get("n", 1) for r, p in requests.items()})
    return {key: "".join(m.text_delta for m in msgs) for key, msgs in per_seq.items()}, per_seq


def test_wire_round_trip_keeps_the_schema_and_its_key_order():
    params = SamplingParams.from_dict(
        {"structured_outputs": {"json": json.dumps(PERSON), "disable_any_whitespace": True}}
    )
    assert params.structured_outputs.kind == "json"
    assert list(json.loads(params.structured_outputs.json)["properties"]) == ["name", "age", "ok"]
    again = SamplingParams.from_dict(json.loads(json.dumps(params.to_dict())))
    assert again == params
    assert "structured_outputs" not in SamplingParams().to_dict()
    for bad, param in [
        ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
        ({}, "structured_outputs"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"json": "{nope"}, "structured_outputs.json"),
        ({"pattern": "x"}, "structured_outputs.pattern"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams.from_dict({"structured_outputs": bad})
        assert e.value.param == param, bad


@pytest.mark.parametrize(
    "spec, param",
    [
        ({"json": '{"type": "nope"}'}, "structured_outputs.json"),
        ({"regex": "(a"}, "structured_outputs.regex"),
        ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
    ],
)
def test_an_invalid_constraint_is_refused_before_it_runs(engine, spec, param):
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("bad", "Hi", SamplingParams.from_dict({"structured_outputs": spec}))
    assert e.value.param == param and "/project/cpp" not in e.value.message, e.value.message


def test_the_compile_cache_returns_the_same_grammar(engine):
    spec = StructuredOutputs(regex=r"[ab]{2}c")
    engine.structured_outputs.check(spec)
    first = engine.structured_outputs.compiled(spec)
    first.result(timeout=60)
    engine.structured_outputs.check(StructuredOutputs(regex=r"[ab]{2}c"))  # an equal spec: a hit
    assert engine.structured_outputs.compiled(StructuredOutputs(regex=r"[ab]{2}c")) is first


def test_bitmask_masks_only_the_constrained_rows_and_logprobs_stay_raw():
    torch.manual_seed(0)
    V = 1000
    logits = torch.randn(3, V)
    allowed_ids = [5, 17, 900]
    bitmask = torch.zeros(3, (V + 31) // 32, dtype=torch.int32)
    for t in allowed_ids:
        bitmask[1, t // 32] |= 1 << (t % 32)
    mask = TokenBitmask(bitmask, rows=(1,))
    assert mask.allowed(1, V).nonzero().flatten().tolist() == allowed_ids
    params = SamplingParams(temperature=0.0, logprobs=2)
    rows = [SamplingRow(params, None, (1,), (), (0,)) for _ in range(3)]
    out = Sampler().sample(logits.clone(), rows, mask)
    assert [o.token_id for o in out][::2] == logits[::2].argmax(-1).tolist()  # unconstrained rows untouched
    assert out[1].token_id == allowed_ids[int(logits[1, allowed_ids].argmax())]
    raw = logits.log_softmax(-1)
    for i, o in enumerate(out):  # raw model logprobs, before the mask
        assert o.logprob == pytest.approx(float(raw[i, o.token_id]), abs=1e-5)
        assert list(o.top_token_ids) == raw[i].topk(2).indices.tolist()
    # random rows too
    rows = [SamplingRow(SamplingParams(temperature=1.0), None, (1,), (), (0,)) for _ in range(3)]
    for _ in range(20):
        assert Sampler().sample(logits.clone(), rows, mask)[1].token_id in allowed_ids


def test_kinds_are_enforced_on_a_random_model_with_n3_siblings(engine):
    regex = r"\d{3}-\d{4}"
    texts, per_seq = run(
        engine,
        {
            "json": {"n": 3, "max_tokens": 300, "temperature": 1.0, "seed": 1, "structured_outputs": {"json": PERSON}},
            "regex": {"n": 3, "max_tokens": 20, "temperature": 1.0, "seed": 2, "structured_outputs": {"regex": regex}},
            "choice": {
                "n": 3,
                "max_tokens": 20,
                "temperature": 1.0,
                "seed": 3,
                "structured_outputs": {"choice": ["alpha", 'beta "quoted"', "gamma\n"]},
            },
            "grammar": {
                "n": 3,
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": 4,
                "structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]? "y"'},
            },
            "free": {"n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True},
        },
    )
    for i in range(3):
        jsonschema.validate(json.loads(texts[("json", i)]), PERSON)
        assert re.fullmatch(regex, texts[("regex", i)])
        assert texts[("choice", i)] in ("alpha", 'beta "quoted"', "gamma\n")
        assert re.fullmatch(r"x[0-9]{1,2}y", texts[("grammar", i)])
        for kind in ("json", "regex", "choice", "grammar"):
            assert per_seq[(kind, i)][-1].finish_reason is FinishReason.STOP
    assert len({texts[("json", i)] for i in range(3)}) == 3  # each sibling walked its own grammar
    assert all(len(m.token_ids) <= 1 for msgs in per_seq.values() for m in msgs)
    assert engine.block_manager.stats().used == 0


def test_constrained_rows_do_not_change_unconstrained_neighbours(engine):
    alone, _ = run(engine, {"free": {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}})
    mixed, _ = run(
        engine,
        {
            "free": {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True},
            "json": {
                "n": 2,
                "max_tokens": 60,
                "temperature": 1.0,
                "seed": 9,
                "structured_outputs": {"json_object": True},
            },
        },
    )
    assert mixed[("free", 0)] == alone[("free", 0)]


def test_preempted_constrained_sequences_recompute_to_the_same_valid_output():
    requests = {
        f"r{i}": {"max_tokens": 90, "temperature": 1.0, "seed": 20 + i, "structured_outputs": {"json": PERSON}}
        for i in range(4)
    }
    roomy = tiny_engine(num_kv_blocks=128)
    expected, _ = run(roomy, requests)
    tight = tiny_engine(num_kv_blocks=12, max_model_len=96)  # 96 slots for 4 sequences of ~45 tokens: preemption
    got, _ = run(tight, requests)
    assert tight.stats().num_preemptions > 0
    assert got == expected
    for text in got.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_length_stop_strings_and_min_tokens_on_constrained_sequences(engine):
    texts, per_seq = run(
        engine,
        {
            "cut": {"max_tokens": 3, "temperature": 1.0, "seed": 1, "structured_outputs": {"json": PERSON}},
            "stop": {
                "max_tokens": 30,
                "temperature": 0.0,
                "stop": ["-"],
                "structured_outputs": {"regex": r"\d{3}-\d{4}"},
            },
            # min_tokens bans EOS, which the grammar requires after "ok": the grammar wins, the sequence ends
            "min": {"max_tokens": 30, "min_tokens": 10, "temperature": 0.0, "structured_outputs": {"choice": ["ok"]}},
        },
    )
    assert per_seq[("cut", 0)][-1].finish_reason is FinishReason.LENGTH and texts[("cut", 0)].startswith("{")
    assert per_seq[("stop", 0)][-1].finish_reason is FinishReason.STOP and per_seq[("stop", 0)][-1].stop_reason == "-"
    assert re.fullmatch(r"\d{3}", texts[("stop", 0)])
    assert texts[("min", 0)] == "ok" and per_seq[("min", 0)][-1].finish_reason is FinishReason.STOP


def test_abort_while_the_grammar_compiles_ends_the_request(engine):
    spec = {"json": {"type": "object", "properties": {"unique_field_for_this_test": {"type": "integer"}}}}
    engine.add_request(
        engine.make_request("slow", "Hi", SamplingParams.from_dict({"n": 2, "structured_outputs": spec}))
    )
    assert engine.has_work()
    engine.abort_request("slow")
    outputs = run_to_completion(engine)
    per_seq = check_stream_invariants(outputs, {"slow": 2})
    assert [msgs[-1].finish_reason for msgs in per_seq.values()] == [FinishReason.ABORT] * 2
    assert not engine.has_work() and engine.block_manager.stats().used == 0


def test_a_compiling_grammar_stalls_no_other_request(monkeypatch):
    engine = tiny_engine()
    release = threading.Event()
    compiler = engine.structured_outputs
    real_compiled = compiler.compiled

    def gated(spec):  # the grammar is "compiled" only when the test releases it
        future, gate = real_compiled(spec), concurrent.futures.Future()
        threading.Thread(target=lambda: (release.wait(30), gate.set_result(future.result())), daemon=True).start()
        return gate

    monkeypatch.setattr(compiler, "compiled", gated)
    engine.add_request(
        engine.make_request(
            "phone", "Hi", SamplingParams.from_dict({"max_tokens": 20, "structured_outputs": {"regex": r"\d{3}-\d{4}"}})
        )
    )
    engine.add_request(
        engine.make_request("free", "Hi", SamplingParams.from_dict({"max_tokens": 5, "ignore_eos": True}))
    )
    outputs = []
    while not any(o.request_id == "free" and o.request_finished for o in outputs):
        outputs.extend(engine.step())
    assert all(o.request_id == "free" for o in outputs)  # the free request ran to its end meanwhile
    assert engine.stats().num_waiting == 1
    release.set()
    outputs = run_to_completion(engine)
    (msgs,) = check_stream_invariants(outputs, {"phone": 1}).values()
    assert re.fullmatch(r"\d{3}-\d{4}", "".join(m.text_delta for m in msgs))


def test_the_forced_call_schema_of_several_tools_yields_valid_calls(engine):
    from openai_frontend.schemas import Tool
    from openai_frontend.tool_calls import ToolPlan, forced_call_schema, parse_call_list

    tools = tuple(
        Tool.model_validate(t)
        for t in [
            {
                "type": "function",
                "function": {
                    "name": "add",
                    "parameters": {
                        "type": "object",
                        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["x"],
                    },
                },
            },
            {"type": "function", "function": {"name": "now"}},
        ]
    )
    schema = forced_call_schema(ToolPlan("required", tools, None, parallel=False))
    texts, _ = run(
        engine,
        {"calls": {"n": 4, "max_tokens": 80, "temperature": 1.0, "seed": 3, "structured_outputs": {"json": schema}}},
    )
    for text in texts.values():
        (call,) = parse_call_list(text)
        assert call.name in ("add", "now")
        if call.name == "add":
            assert 0 <= json.loads(call.arguments)["x"] <= 9
