"""Joining a sequence's pending steps when the sender falls behind (backend/coalescing.py).

The joined stream must be the stream: the same tokens, text, logprobs, counts and flags, in an order
that keeps every request's final message last.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from backend.coalescing import PendingResponses, StreamInterval, join_steps
from backend.engine_loop import EngineLoop
from protocol import FinishReason, RequestFailure, SamplingParams, StepOutput
from tests.engine_helpers import check_stream_invariants, coalesce, run_to_completion, tiny_engine


def joined_view(outputs) -> dict[int, tuple]:
    """Per sequence: its tokens, text, logprob entries, last counts and finish, whatever the grouping."""
    view = {}
    for seq in sorted({o.seq_index for o in outputs}):
        msgs = [o for o in outputs if o.seq_index == seq]
        lps = [lp for m in msgs if (lp := m.logprobs) is not None]
        view[seq] = (
            [t for m in msgs for t in m.token_ids],
            "".join(m.text_delta for m in msgs),
            [x for lp in lps for x in zip(lp.logprobs, lp.token_texts, lp.top_token_ids, lp.top_logprobs)],
            msgs[-1].num_output_tokens,
            msgs[-1].finish_reason,
            msgs[-1].stop_reason,
            msgs[0].prompt_logprobs,
            sum(m.num_steps for m in msgs),
            {m.num_cached_tokens for m in msgs},
        )
    return view


def sampling(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, logprobs=2, prompt_logprobs=1, seed=7, temperature=1.0)


def engine_outputs(n: int = 2, max_tokens: int = 9) -> list[StepOutput]:
    engine = tiny_engine()
    engine.add_request(engine.make_request("r", "hello there", sampling(n, max_tokens)))
    return [o for o in run_to_completion(engine) if isinstance(o, StepOutput)]


def loop_outputs(n: int, max_tokens: int, send_delay: float = 0.0, **loop_settings) -> list:
    """What the sink of engine_outputs' request receives through an EngineLoop (each send taking
    `send_delay` seconds), to the request's last response."""
    received: list = []
    done = threading.Event()

    def send(sink, output):
        time.sleep(send_delay)
        received.append(output)
        if isinstance(output, RequestFailure) or output.request_finished:
            done.set()

    engine = tiny_engine()
    loop = EngineLoop(lambda: engine, send=send, **loop_settings)
    loop.start()
    try:
        loop.submit(engine.make_request("r", "hello there", sampling(n, max_tokens)), "sink")
        assert done.wait(60)
    finally:
        loop.stop()
    return received


def test_joining_all_steps_of_a_sequence_keeps_everything():
    outputs = engine_outputs()
    for seq in (0, 1):
        msgs = [o for o in outputs if o.seq_index == seq]
        joined = join_steps(msgs)
        assert joined.step == 0 and joined.num_steps == len(msgs)
        assert joined_view([joined]) == {seq: joined_view(msgs)[seq]}
        assert joined.request_finished == msgs[-1].request_finished
        assert joined.timings == msgs[-1].timings is not None  # (only a sequence's last message has them)
        cached = [dataclasses.replace(m, num_cached_tokens=16) for m in msgs]
        assert join_steps(cached).num_cached_tokens == 16


def test_joining_messages_that_are_joined_already_keeps_everything():
    # (The engine thread hands the sender what it had no time to send, joined per sequence.)
    msgs = [o for o in engine_outputs(max_tokens=9) if o.seq_index == 0]
    twice = join_steps([join_steps(msgs[:2]), msgs[2], join_steps(msgs[3:])])
    assert twice == join_steps(msgs)
    with pytest.raises(AssertionError, match="consecutive"):
        join_steps([join_steps(msgs[:2]), msgs[3]])


def test_coalesce_joins_per_sequence_and_keeps_the_final_message_last():
    outputs = engine_outputs()
    failure = RequestFailure("other", "boom")
    pending = [("sink", o) for o in outputs[:3]] + [("other-sink", failure)] + [("sink", o) for o in outputs[3:]]
    sent = coalesce(pending)
    assert sum(covered for _, _, covered in sent) == len(pending)
    messages = [out for _, out, _ in sent]
    assert len(messages) == 3  # seq 0 joined, the failure alone, seq 1 joined
    assert messages[-1].request_finished and not any(getattr(m, "request_finished", False) for m in messages[:-1])
    assert messages.index(failure) == 0  # its group ends before the sequences' groups do
    steps_only = [m for m in messages if isinstance(m, StepOutput)]
    assert joined_view(steps_only) == joined_view(outputs)
    check_stream_invariants(steps_only, {"r": 2})


def test_requests_that_end_go_out_before_those_that_go_on():
    outputs = engine_outputs()  # request "r": two sequences, to the end
    going_on = [StepOutput("on", 0, step, (1,), "a", None, None, None, 3, step + 1) for step in (5, 6)]
    failed = RequestFailure("failed", "boom")
    pending = [("on-sink", going_on[0])] + [("sink", o) for o in outputs] + [("on-sink", going_on[1]), ("f", failed)]
    messages = [out for _, out, _ in coalesce(pending)]
    assert [m.request_id for m in messages] == ["r", "r", "failed", "on"]
    assert messages[1].request_finished and messages[3].step == 5 and messages[3].num_steps == 2
    check_stream_invariants(messages[:2], {"r": 2})


def _step(request_id: str, step: int, finished: bool = False) -> StepOutput:
    finish = FinishReason.LENGTH if finished else None
    return StepOutput(request_id, 0, step, (1,), "a", None, finish, None, 3, step + 1, request_finished=finished)


def test_pending_responses_send_ended_requests_first_and_join_what_arrives_meanwhile():
    pending: PendingResponses[str] = PendingResponses()
    pending.add("a", _step("a", 0))
    pending.add("b", _step("b", 0))
    assert [(s, m.request_id, m.step, c) for s, m, c in pending.take()] == [("a", "a", 0, 1)]  # the oldest
    pending.add("a", _step("a", 1))
    pending.add("b", _step("b", 1, finished=True))  # b ends while a waits longer: b goes first
    pending.add("a", _step("a", 2))
    ((sink, message, covered),) = pending.take()
    assert (sink, message.request_id, message.step, message.num_steps, covered) == ("b", "b", 0, 2, 2)
    assert message.request_finished
    ((sink, message, covered),) = pending.take()  # a's steps that came meanwhile, joined
    assert (message.request_id, message.step, message.num_steps, covered) == ("a", 1, 2, 2)
    assert not pending


def test_a_request_id_used_again_after_its_request_ended_is_a_new_request():
    pending: PendingResponses[str] = PendingResponses()
    pending.add("old", _step("r", 0, finished=True))
    pending.add("new", _step("r", 0))
    first, second = pending.take(), pending.take()
    assert [(s, m.request_finished) for s, m, _ in first] == [("old", True)]
    assert [(s, m.request_finished) for s, m, _ in second] == [("new", False)]
    assert not pending


def test_a_slow_consumer_gets_fewer_responses_and_the_same_stream():
    # The engine steps on while the sender sleeps on every response: steps queue up, and each sequence's
    # pending steps go out as one response. Joined, the stream equals the engine's own, step by step.
    want = engine_outputs(n=2, max_tokens=24)
    received = loop_outputs(n=2, max_tokens=24, send_delay=0.02)
    assert all(isinstance(o, StepOutput) for o in received)
    assert len(received) < len(want) and any(o.num_steps > 1 for o in received)
    check_stream_invariants(received, {"r": 2})
    assert received[-1].request_finished and sum(o.request_finished for o in received) == 1
    assert joined_view(received) == joined_view(want)


def test_stream_interval_sends_the_first_message_at_once_then_groups_and_the_last_at_once():
    held: StreamInterval[str] = StreamInterval(3)
    released = [[(s, m.request_id, m.step) for s, m in held.release([("a", _step("a", k))])] for k in range(5)]
    assert released == [[("a", "a", 0)], [], [], [("a", "a", 1), ("a", "a", 2), ("a", "a", 3)], []]
    assert len(held) == 1
    last = held.release([("a", _step("a", 5, finished=True))])
    assert [(m.step, m.request_finished) for _, m in last] == [(4, False), (5, True)]  # the last never waits
    assert len(held) == 0


def test_stream_interval_releases_a_requests_held_messages_before_its_failure_and_keeps_others():
    held: StreamInterval[str] = StreamInterval(4)
    held.release([("a", _step("a", 0)), ("b", _step("b", 0))])
    assert held.release([("a", _step("a", 1)), ("b", _step("b", 1))]) == []
    failure = RequestFailure("a", "boom")
    out = held.release([("a", failure)])
    assert [(m.request_id, getattr(m, "step", None)) for _, m in out] == [("a", 1), ("a", None)]
    assert [(m.request_id, m.step) for _, m in held.release_all()] == [("b", 1)]
    assert StreamInterval(1).release([("a", _step("a", 1))]) == [("a", _step("a", 1))]


def test_stream_interval_through_the_engine_loop_gives_the_same_stream_in_fewer_responses():
    # n = 2 with logprobs: each sequence's first message alone, then groups of 4 steps, its last at once;
    # joined, the stream equals the engine's own, step by step.
    want = engine_outputs(n=2, max_tokens=11)
    received = loop_outputs(n=2, max_tokens=11, stream_interval=4)
    check_stream_invariants(received, {"r": 2})
    assert joined_view(received) == joined_view(want)
    for seq in (0, 1):
        msgs = [o for o in received if o.seq_index == seq]
        lengths = [o.num_steps for o in msgs]
        assert lengths[0] == 1 and all(k <= 4 for k in lengths) and msgs[-1].finished
        assert len(msgs) < len([o for o in want if o.seq_index == seq])
        if not any(o.finished for o in want if o.seq_index == seq and o.step < 5):  # (an early stop ends sooner)
            assert lengths[1] == 4
