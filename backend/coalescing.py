"""Joining the pending step messages of a sequence when the sender fell behind (docs/contract.md).

The engine makes one StepOutput per sequence per step. When responses are produced faster than they
can be sent (a large batch, a slow transport), the sender finds several of them queued; sending the
consecutive steps of one sequence as one message lowers the response rate below the step rate
without losing or reordering anything: the joined message covers steps `step` .. `step + num_steps - 1`
with all their tokens, text, logprobs and the last one's counts and flags, so a receiver that joins
messages gets exactly the stream it would have got step by step.

Order (PendingResponses): requests that have ended go first, since their clients wait on them (a
non-streaming client waits for nothing else, and a closed-loop one sends its next request only then);
the others follow, the one waiting longest first. Within a request each group is placed where its
last message was queued, so a request's final message (and a RequestFailure, never joined) still comes
after everything else of that request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

from protocol import EngineOutput, RequestFailure, StepOutput, TokenLogprobs

Sink = TypeVar("Sink")


def join_steps(outputs: Sequence[StepOutput]) -> StepOutput:
    """Consecutive messages of one sequence (each covering one step or several) -> one message covering
    all their steps."""
    first, last = outputs[0], outputs[-1]
    if len(outputs) == 1:
        return first
    assert all(o.request_id == first.request_id and o.seq_index == first.seq_index for o in outputs)
    assert all(b.step == a.step + a.num_steps for a, b in zip(outputs, outputs[1:])), "steps must be consecutive"
    assert not any(o.finished for o in outputs[:-1]), "nothing follows a sequence's last message"
    lps = [o.logprobs for o in outputs if o.logprobs is not None]
    logprobs = None
    if lps:
        logprobs = TokenLogprobs(
            logprobs=tuple(x for lp in lps for x in lp.logprobs),
            token_texts=tuple(x for lp in lps for x in lp.token_texts),
            top_token_ids=tuple(x for lp in lps for x in lp.top_token_ids),
            top_logprobs=tuple(x for lp in lps for x in lp.top_logprobs),
            top_token_texts=tuple(x for lp in lps for x in lp.top_token_texts),
        )
    return StepOutput(
        request_id=first.request_id,
        seq_index=first.seq_index,
        step=first.step,
        num_steps=sum(o.num_steps for o in outputs),
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        text_delta="".join(o.text_delta for o in outputs),
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_prompt_tokens=first.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        num_cached_tokens=first.num_cached_tokens,
        request_finished=last.request_finished,
        prompt_logprobs=first.prompt_logprobs,
        embedding=last.embedding,  # (only ever on a sequence's one, last, message)
        timings=last.timings,  # (only ever on a sequence's last message)
    )


class StreamInterval(Generic[Sink]):
    """Holds each sequence's step messages until `interval` of them are pending (vLLM's and SGLang's
    `stream_interval`): fewer, larger responses for less work per token on the path, at the price of
    tokens arriving `interval` at a time. A sequence's first message and its last go at once (the first
    token's latency and the end of a stream never wait), and a request's failure goes after the messages
    held for it. What is released together the sender joins into one response (PendingResponses).
    Engine thread only.
    """

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.interval = interval
        self._held: dict[tuple[str, int], list[tuple[Sink, StepOutput]]] = {}

    def __len__(self) -> int:
        """How many messages are held."""
        return sum(len(held) for held in self._held.values())

    def release(self, routed: list[tuple[Sink, EngineOutput]]) -> list[tuple[Sink, EngineOutput]]:
        """One step's messages -> those to send now, in order (held ones first where they join)."""
        if self.interval == 1:
            return routed
        ready: list[tuple[Sink, EngineOutput]] = []
        for sink, output in routed:
            if isinstance(output, RequestFailure):
                ready.extend(self.release_request(output.request_id))
                ready.append((sink, output))
                continue
            key = (output.request_id, output.seq_index)
            held = self._held.get(key)
            if held is None:
                held = self._held[key] = []
            held.append((sink, output))
            if output.step == 0 or output.finished or output.request_finished or len(held) >= self.interval:
                ready.extend(held)
                del self._held[key]
        return ready

    def release_request(self, request_id: str) -> list[tuple[Sink, EngineOutput]]:
        """Every message held for `request_id`."""
        keys = [key for key in self._held if key[0] == request_id]
        return [pair for key in keys for pair in self._held.pop(key)]

    def release_all(self) -> list[tuple[Sink, EngineOutput]]:
        ready = [pair for held in self._held.values() for pair in held]
        self._held.clear()
        return ready


class _Request(Generic[Sink]):
    """One request's unsent messages: per sequence its pending steps, and a failure if one came."""

    __slots__ = ("request_id", "sink", "steps", "last", "failure", "ended")

    def __init__(self, request_id: str, sink: Sink) -> None:
        self.request_id, self.sink = request_id, sink
        self.steps: dict[int, list[StepOutput]] = {}  # seq_index -> pending steps, in order
        self.last: dict[int, int] = {}  # seq_index -> arrival number of its last pending step
        self.failure: tuple[int, RequestFailure] | None = None
        self.ended = False  # its final message or a failure is among them: nothing more will come


class PendingResponses(Generic[Sink]):
    """What the sender has not sent yet, held per request and sequence so that each response joins all
    that its sequence has pending when it goes out.

    `take()` gives the next request's responses: first the requests that have ended (their clients
    wait on them; a closed-loop client sends its next request only then), in the order they ended,
    then the others, the one waiting longest first. A request's responses go in the order of each
    group's last message, so its final message or failure is last. Adding and taking cost O(1) per
    message, however far the sender has fallen behind.
    """

    def __init__(self) -> None:
        self._open: dict[str, _Request[Sink]] = {}  # request id -> its entry, until it has ended
        self._waiting: dict[_Request[Sink], None] = {}  # every entry, oldest first
        self._ended: dict[_Request[Sink], None] = {}  # ended entries, in the order they ended
        self._arrivals = 0

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, sink: Sink, output: EngineOutput) -> None:
        entry = self._open.get(output.request_id)
        if entry is None:  # (a request id used again after its request ended starts a new entry)
            entry = self._open[output.request_id] = _Request(output.request_id, sink)
            self._waiting[entry] = None
        self._arrivals += 1
        if isinstance(output, RequestFailure):
            entry.failure = (self._arrivals, output)
        else:
            entry.steps.setdefault(output.seq_index, []).append(output)
            entry.last[output.seq_index] = self._arrivals
        if isinstance(output, RequestFailure) or output.request_finished:
            entry.ended = True
            del self._open[output.request_id]
            self._ended[entry] = None

    def take(self) -> list[tuple[Sink, EngineOutput, int]]:
        """The next request's responses as (sink, message, how many queued messages it covers)."""
        entry = next(iter(self._ended or self._waiting))
        del self._waiting[entry]
        if entry.ended:
            del self._ended[entry]
        else:
            del self._open[entry.request_id]
        groups: list[tuple[int, EngineOutput, int]] = [
            (entry.last[seq], join_steps(steps), len(steps)) for seq, steps in entry.steps.items()
        ]
        if entry.failure is not None:
            groups.append((entry.failure[0], entry.failure[1], 1))
        groups.sort(key=lambda group: group[0])
        return [(entry.sink, message, covered) for _, message, covered in groups]
