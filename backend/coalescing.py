"""Joining the pending step messages of a sequence when the sender fell behind (docs/contract.md).

The engine makes one StepOutput per sequence per step. When responses are produced faster than they
can be sent (a large batch, a slow transport), the sender finds several of them queued; sending the
consecutive steps of one sequence as one message lowers the response rate below the step rate
without losing or reordering anything: the joined message covers steps `step` .. `step + num_steps - 1`
with all their tokens, text, logprobs and the last one's counts and flags, so a receiver that joins
messages gets exactly the stream it would have got step by step.

Order: the groups of requests that end in the batch go first, since their clients wait on them (a
non-streaming client waits for nothing else, and a closed-loop one sends its next request only then);
the others follow. Either way a group is placed where its last message was queued, so a request's
final message (and a RequestFailure, never joined) still comes after everything else of that request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from backend.types import EngineOutput, StepOutput, TokenLogprobs

Sink = TypeVar("Sink")


def join_steps(outputs: Sequence[StepOutput]) -> StepOutput:
    """Consecutive messages of one sequence -> one message covering all their steps."""
    first, last = outputs[0], outputs[-1]
    if len(outputs) == 1:
        return first
    assert all(o.request_id == first.request_id and o.seq_index == first.seq_index for o in outputs)
    assert [o.step for o in outputs] == list(range(first.step, first.step + len(outputs))), "steps must be consecutive"
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
        request_finished=last.request_finished,
        prompt_logprobs=first.prompt_logprobs,
    )


def coalesce(pending: Sequence[tuple[Sink, EngineOutput]]) -> list[tuple[Sink, EngineOutput, int]]:
    """Queued (sink, message) pairs -> (sink, message, how many queued messages it covers), each
    sequence's consecutive steps joined; ending requests first, then in the order of each group's last
    message."""
    groups: dict[object, list[int]] = {}
    for i, (_, out) in enumerate(pending):
        key = (out.request_id, out.seq_index) if isinstance(out, StepOutput) else ("failure", i)
        groups.setdefault(key, []).append(i)
    ending = {out.request_id for _, out in pending if not isinstance(out, StepOutput) or out.request_finished}
    result = []
    for indices in sorted(groups.values(), key=lambda idx: (pending[idx[0]][1].request_id not in ending, idx[-1])):
        sink, out = pending[indices[0]]
        if isinstance(out, StepOutput) and len(indices) > 1:
            out = join_steps([pending[i][1] for i in indices])
        result.append((sink, out, len(indices)))
    return result
