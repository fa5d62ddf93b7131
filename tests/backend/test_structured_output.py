"""Structured outputs in the engine: xgrammar masks, one matcher per sequence, compile cache, and the
engine's other mechanisms (preemption, n > 1, min_tokens, stop strings, abort) on constrained
sequences. The tiny random model (tests/engine_helpers.py) writes gibberish, so only the constraint
can make its output valid: every validity assertion here fails if enforcement breaks."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jsonschema
import psutil
import pytest
import torch

from backend.grammar_compiler import GrammarBudget, StructuredOutputCompiler
from backend.grammar_limits import DEFAULT_LIMITS, check_limits
from backend.sampler import Sampler, SamplingRow
from backend.structured_output import TokenBitmask, build_grammar
from protocol import (
    EngineOverloaded,
    FinishReason,
    InvalidRequestError,
    RequestFailure,
    SamplingParams,
    StructuredOutputs,
)
from tests.engine_helpers import check_stream_invariants, run_to_completion, smollm2_tokenizer, tiny_engine

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


# -- the compiler's limits, lanes and budgets (backend/grammar_limits.py, backend/grammar_compiler.py) --------


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):  # each array schema is one JSON object: depth objects in all
        schema = {"type": "array", "items": schema}
    return schema


def properties(count: int, prefix: str = "field") -> dict:
    return {"type": "object", "properties": {f"{prefix}_{i}": {"type": "integer"} for i in range(count)}}


def two_enums(each: int) -> dict:
    values = [f"v{i}" for i in range(each)]
    return {"type": "object", "properties": {"a": {"enum": values}, "b": {"enum": values}}}


def big_but_cheap(tag: str) -> dict:
    """Long enough for the big lane (its description), trivial to compile."""
    return {"type": "object", "description": tag + "x" * 20_000, "properties": {tag: {"type": "integer"}}}


@pytest.mark.parametrize(
    "spec, param, limit",
    [
        ({"json": nested_arrays(65)}, "structured_outputs.json", "64"),
        ({"json": properties(5001)}, "structured_outputs.json", "5000"),
        ({"json": two_enums(2501)}, "structured_outputs.json", "5000"),  # summed over the schema
        ({"json": {"type": "string", "description": "x" * (1 << 20)}}, "structured_outputs.json", "1048576"),
        ({"choice": [f"c{i}" for i in range(5001)]}, "structured_outputs.choice", "5000"),
        ({"choice": ["a" * 150_000, "b" * 150_000]}, "structured_outputs.choice", "262144"),
        ({"regex": "a" * 16385}, "structured_outputs.regex", "16384"),
        ({"grammar": 'root ::= "a"' + " " * 65_536}, "structured_outputs.grammar", "65536"),
        ({"regex": "[^x]{1,100}" * 33}, "structured_outputs.regex", "32"),
        (
            {"grammar": "root ::= " + " ".join(f'[^{c}]{{17,}} "{c}"' for c in "abcdefghijklmnopqrstuvwxyzABCDEFG")},
            "structured_outputs.grammar",
            "32",
        ),
        ({"json": {"type": "string", "pattern": "[a-z]{1,20}" * 33}}, "structured_outputs.json", "32"),
        (
            {"json": {"type": "array", "items": [{"type": "string", "maxLength": 100}] * 129}},
            "structured_outputs.json",
            "128",
        ),
        ({"json": {"enum": ["x" * 1000] * 263}}, "structured_outputs.json", "262144"),
    ],
)
def test_a_constraint_over_a_limit_is_refused_before_xgrammar_parses_it(engine, monkeypatch, spec, param, limit):
    def parse(spec):
        raise AssertionError("parsed a constraint over a limit")

    monkeypatch.setattr("backend.grammar_compiler.build_grammar", parse)
    with pytest.raises(InvalidRequestError) as e:
        engine.make_request("big", "Hi", SamplingParams.from_dict({"structured_outputs": spec}))
    assert e.value.param == param and limit in e.value.message, e.value.message


def test_the_limits_leave_room_for_real_schemas_and_survive_any_nesting():
    for schema in (nested_arrays(64), properties(5000), two_enums(2500)):
        check_limits(StructuredOutputs(json=json.dumps(schema)))
    check_limits(StructuredOutputs(choice=tuple(f"c{i}" for i in range(5000))))
    ipv6 = "(" + "|".join(["([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}"] * 12) + ")"  # short repetitions are not counted
    check_limits(StructuredOutputs(regex=ipv6))
    check_limits(StructuredOutputs(regex=r"\w{1,100}@\w{1,100}\.com" * 16))
    deep = StructuredOutputs(json="[" * 400_000 + "]" * 400_000)  # past the JSON parser's own recursion guard
    with pytest.raises(InvalidRequestError) as e:
        check_limits(deep)
    assert e.value.param == "structured_outputs.json" and "64" in e.value.message


def make_compiler(**budget) -> StructuredOutputCompiler:
    tok = smollm2_tokenizer()
    return StructuredOutputCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids), GrammarBudget(**budget))


@pytest.fixture
def compilers():
    """Makes compilers (`compilers(**budget)`) and closes them at the end, so that no worker outlives its test."""
    made: list[StructuredOutputCompiler] = []

    def make(**budget) -> StructuredOutputCompiler:
        compiler = make_compiler(**budget)
        made.append(compiler)
        return compiler

    yield make
    for compiler in made:
        compiler.close()


class Gate:
    """Compiles whose constraint holds `mark` wait in their worker (tests/backend/gated_grammar_worker.py)
    until `release`."""

    def __init__(self, release_file) -> None:
        self._release_file = release_file

    def release(self) -> None:
        self._release_file.touch()


@pytest.fixture
def gate(monkeypatch, tmp_path):
    """`gate(compiler, mark)`: the compiler's workers (started here) hold the trials of constraints holding
    `mark` until the test releases them; released and closed at the end."""
    release_file = tmp_path / "release"

    def install(compiler: StructuredOutputCompiler, mark: str) -> Gate:
        monkeypatch.setenv("GRAMMAR_GATE_MARK", mark)
        monkeypatch.setenv("GRAMMAR_GATE_RELEASE", str(release_file))
        compiler._worker_module = "tests.backend.gated_grammar_worker"  # the process boundary
        compiler.warm_up()
        gated.append(compiler)
        return Gate(release_file)

    gated: list[StructuredOutputCompiler] = []
    yield install
    release_file.touch()
    for compiler in gated:
        compiler.close()


def wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_big_compile_never_delays_a_small_one_and_a_full_big_lane_refuses_at_once(gate):
    compiler = make_compiler(timeout_s=60)
    gated = gate(compiler, "first")
    big = StructuredOutputs(json=json.dumps(big_but_cheap("first")))
    compiler.check(big)
    slow = compiler.compiled(big)
    small = StructuredOutputs(regex=r"\d{3}-\d{4}")
    compiler.check(small)
    started = time.monotonic()
    assert compiler.compiled(small).result(timeout=30) is not None
    assert time.monotonic() - started < 5 and not slow.done()
    with pytest.raises(EngineOverloaded) as e:  # at once, not queued behind the running compile
        compiler.check(StructuredOutputs(json=json.dumps(big_but_cheap("second"))))
    assert e.value.param == "structured_outputs.json" and e.value.code == "overloaded"
    gated.release()
    assert slow.result(timeout=30) is not None
    compiler.check(StructuredOutputs(json=json.dumps(big_but_cheap("second"))))  # the lane is free again


def test_a_compile_past_its_time_budget_is_killed_refused_and_refused_again_at_once(compilers):
    compiler = compilers(timeout_s=0.5)
    compiler.warm_up()
    (big_worker,) = compiler.stats().big_lane_workers
    # Optional properties compile in time quadratic in their number: this one takes seconds.
    spec = StructuredOutputs(json=json.dumps(properties(5000)))
    compiler.check(spec)  # (xgrammar's parse alone takes a while)
    started = time.monotonic()
    slow = compiler.compiled(spec)
    small = StructuredOutputs(regex=r"[0-9]{2}x")
    compiler.check(small)
    assert compiler.compiled(small).result(timeout=30) is not None and not slow.done()  # answered meanwhile
    with pytest.raises(InvalidRequestError) as e:
        slow.result(timeout=30)
    assert time.monotonic() - started < 0.5 + 3
    assert e.value.param == "structured_outputs.json" and "too complex to compile in time" in e.value.message
    # The worker that compiled it is gone, and its memory with it; the lane's seat is free and a new
    # worker has it.
    wait_until(lambda: gone(big_worker) and compiler.stats().big_lane_running == 0, timeout_s=5)
    wait_until(lambda: len(compiler.stats().big_lane_workers) == 1)
    assert compiler.stats().big_lane_workers != (big_worker,)
    assert compiler.stats().cached_grammars == 1  # the small one
    assert compiler._compiler is not None  # (the small one was compiled here; the killed one never was)
    with pytest.raises(InvalidRequestError) as again:
        compiler.check(spec)
    assert again.value.message == e.value.message
    other = StructuredOutputs(json=json.dumps(big_but_cheap("after")))  # the new worker compiles
    compiler.check(other)
    assert compiler.compiled(other).result(timeout=30) is not None


def test_a_compile_past_its_memory_budget_ends_its_worker_and_is_refused(monkeypatch):
    """An enum over the request limit (allowed here) whose compile grows for seconds: the worker ends once
    it holds more than the budget, long before the time budget, and the constraint is refused as such."""
    limits = dataclasses.replace(DEFAULT_LIMITS, max_enum_values=10**6, max_enum_chars=1 << 24)
    tok = smollm2_tokenizer()
    budget = GrammarBudget(timeout_s=60, compile_memory_bytes=24 << 20)
    compiler = StructuredOutputCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids), budget, limits)
    try:
        compiler.warm_up()
        (worker,) = compiler.stats().big_lane_workers
        spec = StructuredOutputs(json=json.dumps({"enum": [f"value-{i}" for i in range(40_000)]}))
        compiler.check(spec)
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as e:
            compiler.compiled(spec).result(timeout=60)
        assert time.monotonic() - started < 30  # (the time budget is 60 s)
        assert e.value.param == "structured_outputs.json" and "more than 24 MiB of memory" in e.value.message
        assert gone(worker)
        wait_until(lambda: len(compiler.stats().big_lane_workers) == 1 and compiler.stats().big_lane_running == 0)
        with pytest.raises(InvalidRequestError):  # remembered
            compiler.check(spec)
        small = StructuredOutputs(json=json.dumps(big_but_cheap("after")))  # the new worker compiles
        compiler.check(small)
        assert compiler.compiled(small).result(timeout=30) is not None
    finally:
        compiler.close()


def test_a_short_constraint_past_its_time_is_killed_and_frees_its_seat(gate):
    compiler = make_compiler(timeout_s=0.3)
    gated = gate(compiler, "[q-z]")
    small_workers = compiler.stats().small_lane_workers
    slow = StructuredOutputs(regex="[q-z]{3}")
    compiler.check(slow)
    with pytest.raises(InvalidRequestError) as e:
        compiler.compiled(slow).result(timeout=30)
    assert e.value.param == "structured_outputs.regex"
    wait_until(lambda: compiler.stats().small_lane_running == 0, timeout_s=5)
    killed = [pid for pid in small_workers if gone(pid)]
    assert len(killed) == 1
    quick = StructuredOutputs(regex="[a-c]{3}")
    compiler.check(quick)
    assert compiler.compiled(quick).result(timeout=30) is not None
    big = StructuredOutputs(json=json.dumps(big_but_cheap("other")))
    compiler.check(big)  # the big lane was never taken
    assert compiler.compiled(big).result(timeout=30) is not None
    wait_until(lambda: len(compiler.stats().small_lane_workers) == 2)
    assert killed[0] not in compiler.stats().small_lane_workers
    gated.release()
    assert compiler.stats().cached_grammars == 2  # the quick one and the big one


def test_a_worker_that_dies_fails_its_compile_and_is_replaced(gate):
    compiler = make_compiler(timeout_s=60)
    gate(compiler, "[k-m]")
    spec = StructuredOutputs(regex="[k-m]{2}")
    compiler.check(spec)
    wait_until(lambda: trial_worker(compiler) is not None)
    os.kill(trial_worker(compiler), signal.SIGKILL)  # as the kernel's OOM killer would
    with pytest.raises(RuntimeError, match="ended while compiling"):
        compiler.compiled(spec).result(timeout=30)
    wait_until(lambda: len(compiler.stats().small_lane_workers) == 2)
    compiler.check(StructuredOutputs(regex="[k-m]{3}x"))  # not refused: it did not run out of time


def trial_worker(compiler: StructuredOutputCompiler) -> int | None:
    """The process id of the worker a trial runs in."""
    with compiler._lock:
        return next((job.worker.pid for job in compiler._cache.values() if job.worker is not None), None)


def test_a_compiled_grammar_over_the_byte_budget_is_refused_and_never_compiled_here(compilers):
    compiler = compilers(max_grammar_bytes=1 << 20, cache_bytes=1 << 20)
    spec = StructuredOutputs(json=json.dumps(PERSON))  # a string property: about 1 MiB of token masks
    compiler.check(spec)
    with pytest.raises(InvalidRequestError) as e:
        compiler.compiled(spec).result(timeout=60)
    assert e.value.param == "structured_outputs.json" and "1.0 MiB per constraint" in e.value.message
    assert compiler.stats().cached_bytes == 0 and compiler._compiler is None  # its trial's size refused it
    small = StructuredOutputs(regex="[ab]{2}")
    compiler.check(small)
    compiler.compiled(small).result(timeout=60)
    assert 0 < compiler.stats().cached_bytes < 1 << 20


def test_the_compile_cache_is_bounded_in_bytes_least_recently_used_out_first(compilers):
    compiler = compilers(max_grammar_bytes=4 << 20, cache_bytes=7 << 20)
    schemas = [PERSON | {"properties": PERSON["properties"] | {f"extra_{i}": {"type": "integer"}}} for i in range(4)]
    specs = [StructuredOutputs(json=json.dumps(schema)) for schema in schemas]
    futures = []
    for spec in specs:  # each a little over 3 MiB: two fit
        compiler.check(spec)
        futures.append(compiler.compiled(spec))
        futures[-1].result(timeout=60)
        assert compiler.stats().cached_bytes <= 7 << 20
    assert compiler.stats().cached_grammars == 2
    assert compiler.compiled(specs[-1]) is futures[-1]  # kept
    compiler.check(specs[0])
    assert compiler.compiled(specs[0]) is not futures[0]  # evicted: compiled again


def test_compiled_grammars_mask_as_xgrammar_compiling_in_process_does(compilers):
    import xgrammar as xgr

    compiler = compilers()
    reference = compiler._make_compiler()
    tok = smollm2_tokenizer()
    specs_and_texts = [
        (StructuredOutputs(json=json.dumps(PERSON)), '{"name": "Al", "age": 42, "ok": true}'),
        (StructuredOutputs(regex=r"\d{3}-\d{4}"), "555-1234"),
        (StructuredOutputs(choice=("yes", "no", "maybe not")), "maybe not"),
        (StructuredOutputs(grammar='root ::= "x" [0-9] [0-9]? "y"'), "x42y"),
    ]
    for spec, text in specs_and_texts:
        compiler.check(spec)
        ours = xgr.GrammarMatcher(compiler.compiled(spec).result(timeout=60))
        theirs = xgr.GrammarMatcher(reference.compile_grammar(build_grammar(spec)))
        for token in [*tok.encode(text, add_special_tokens=False), None]:  # every prefix of a valid output
            masks = [xgr.allocate_token_bitmask(1, tok.vocab_size) for _ in range(2)]
            ours.fill_next_token_bitmask(masks[0])
            theirs.fill_next_token_bitmask(masks[1])
            assert torch.equal(masks[0], masks[1]), (spec, token)
            if token is not None:
                assert ours.accept_token(token) and theirs.accept_token(token)


def test_close_ends_the_workers_and_what_comes_later_fails(compilers):
    compiler = compilers()
    compiler.warm_up()
    pids = compiler.stats().small_lane_workers + compiler.stats().big_lane_workers
    assert len(pids) == 3 and not any(gone(pid) for pid in pids)
    compiler.close()
    assert all(gone(pid) for pid in pids)
    spec = StructuredOutputs(regex="[ab]{5}")
    compiler.check(spec)
    with pytest.raises(RuntimeError, match="engine stopped"):
        compiler.compiled(spec).result(timeout=10)


_SIGKILLED_PARENT = """
import json, sys, time
from backend.grammar_compiler import GrammarBudget, StructuredOutputCompiler
from protocol import StructuredOutputs
from tests.engine_helpers import smollm2_tokenizer
tok = smollm2_tokenizer()
compiler = StructuredOutputCompiler(tok, tok.vocab_size, tuple(tok.eos_token_ids), GrammarBudget(timeout_s=600))
compiler.warm_up()
schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(5000)}}
compiler.check(StructuredOutputs(json=json.dumps(schema)))  # seconds of compiling in the big lane's worker
stats = compiler.stats()
print(json.dumps(stats.small_lane_workers + stats.big_lane_workers), flush=True)
time.sleep(600)
"""


def test_workers_end_with_their_process_even_sigkilled_mid_compile():
    parent = subprocess.Popen(
        [sys.executable, "-c", _SIGKILLED_PARENT], stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 3
        time.sleep(0.5)
        parent.kill()  # SIGKILL: nothing of the parent runs, its pipes close
        parent.wait()
        wait_until(lambda: all(gone(pid) for pid in pids), timeout_s=10)
    finally:
        parent.kill()
        parent.wait()


def test_a_request_whose_grammar_runs_past_the_budget_ends_with_a_refusal(gate):
    engine = tiny_engine(grammar_compile_timeout_s=0.3)
    gate(engine.structured_outputs, r"\d{3}")
    constrained = SamplingParams.from_dict({"structured_outputs": {"regex": r"\d{3}"}})
    started = time.monotonic()
    engine.add_request(engine.make_request("stuck", "Hi", constrained))
    engine.add_request(engine.make_request("free", "Hi", SamplingParams.from_dict({"max_tokens": 3})))
    outputs = run_to_completion(engine)
    (failure,) = [o for o in outputs if isinstance(o, RequestFailure)]
    assert time.monotonic() - started < 0.3 + 5
    assert (failure.request_id, failure.error_type, failure.param) == (
        "stuck",
        "invalid_request_error",
        "structured_outputs.regex",
    )
    assert "too complex to compile in time" in failure.message
    check_stream_invariants(outputs, {"free": 1, "stuck": 1})
    assert not engine.has_work() and engine.stats().num_waiting == 0
