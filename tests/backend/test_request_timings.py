"""Per-sequence engine timings (protocol.RequestTimings) on each sequence's last message, read from a clock the
test sets: the sequence joining the engine, its first scheduling, its first token and its finish."""

from __future__ import annotations

import types

import pytest

import backend.output_processor
import backend.scheduler
import backend.sequence
from protocol import FinishReason, RequestTimings, SamplingParams, StepOutput, Task
from tests.engine_helpers import check_stream_invariants, tiny_engine

PROMPT = "The capital of France is"


class Clock:
    """time.monotonic() of the engine's modules: what the test last set."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    for module in (backend.sequence, backend.scheduler, backend.output_processor):
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock


def run(engine, clock: Clock, start: float = 1.0) -> list[StepOutput]:
    """Steps the engine at clock start, start + 1, ... until it has no work."""
    outputs = []
    clock.now = start
    while engine.has_work():
        outputs += engine.step()
        clock.now += 1
    return outputs


def last_messages(outputs: list[StepOutput]) -> dict[tuple[str, int], StepOutput]:
    for out in outputs:
        assert (out.timings is not None) == out.finished, "timings on a sequence's last message only"
    return {(o.request_id, o.seq_index): o for o in outputs if o.finished}


def test_a_sequence_is_queued_until_scheduled_prefills_until_its_first_token_and_decodes_to_its_finish(clock):
    engine = tiny_engine(max_num_seqs=1)
    greedy = dict(max_tokens=4, ignore_eos=True, temperature=0)
    engine.add_request(engine.make_request("a", PROMPT, SamplingParams(**greedy)))
    engine.add_request(engine.make_request("b", PROMPT, SamplingParams(**greedy)))  # one seat: b waits for a
    outputs = run(engine, clock)  # a: steps at 1, 2, 3, 4; b: 5, 6, 7, 8
    check_stream_invariants(outputs, {"a": 1, "b": 1})
    last = last_messages(outputs)
    assert last[("a", 0)].timings == RequestTimings(queued_s=1.0, prefill_s=0.0, decode_s=3.0)
    assert last[("b", 0)].timings == RequestTimings(queued_s=5.0, prefill_s=0.0, decode_s=3.0)


def test_a_chunked_prompt_prefills_over_several_steps(clock):
    engine = tiny_engine(max_num_batched_tokens=16)
    prompt = list(range(100, 140))  # 40 tokens: chunks at 1, 2 and 3 (which samples), a decode at 4
    engine.add_request(engine.make_request("c", prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    (last,) = last_messages(run(engine, clock)).values()
    assert last.timings == RequestTimings(queued_s=1.0, prefill_s=2.0, decode_s=1.0)


def test_n_siblings_share_their_leaders_queue_and_each_has_its_own_finish(clock):
    engine = tiny_engine()
    clock.now = 0.0
    engine.add_request(engine.make_request("n", PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True)))
    last = last_messages(run(engine, clock, start=2.0))
    assert {o.timings for o in last.values()} == {RequestTimings(queued_s=2.0, prefill_s=0.0, decode_s=2.0)}


def test_an_abort_while_waiting_is_all_queue_and_after_scheduling_has_no_decode(clock):
    engine = tiny_engine(max_num_seqs=1, max_num_batched_tokens=16)
    engine.add_request(engine.make_request("long", list(range(100, 140)), SamplingParams(max_tokens=2)))
    engine.add_request(engine.make_request("waits", PROMPT, SamplingParams(max_tokens=2)))
    clock.now = 1.0
    outputs = engine.step()  # "long" prefills its first chunk; "waits" has no seat
    clock.now = 4.0
    engine.abort_request("long")
    engine.abort_request("waits")
    outputs += run(engine, clock, start=4.0)
    last = last_messages(outputs)
    assert {o.finish_reason for o in last.values()} == {FinishReason.ABORT}
    assert last[("long", 0)].timings == RequestTimings(queued_s=1.0, prefill_s=3.0, decode_s=0.0)
    assert last[("waits", 0)].timings == RequestTimings(queued_s=4.0, prefill_s=0.0, decode_s=0.0)


def test_an_embedding_has_no_decode(clock):
    engine = tiny_engine()
    engine.add_request(engine.make_request("e", PROMPT, SamplingParams(), Task.EMBED))
    (last,) = last_messages(run(engine, clock, start=3.0)).values()
    assert last.embedding is not None
    assert last.timings == RequestTimings(queued_s=3.0, prefill_s=0.0, decode_s=0.0)


def test_timings_on_the_real_clock_are_durations():
    engine = tiny_engine()
    engine.add_request(engine.make_request("r", PROMPT, SamplingParams(n=2, max_tokens=5, ignore_eos=True)))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    for out in last_messages(outputs).values():
        t = out.timings
        assert min(t.queued_s, t.prefill_s, t.decode_s) >= 0
