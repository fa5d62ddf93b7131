"""Continuous-batching scheduler (vLLM V1 style). No torch here.

The one idea: there is no prefill phase and no decode phase. Every sequence has num_tokens
(prompt + generated so far) and num_computed_tokens (how many of them have K/V in the cache); each
step gives each sequence some of its missing tokens, up to a token budget, and that is all.
- A decode is a sequence missing 1 token (the one it sampled last step).
- Chunked prefill is a sequence missing many tokens that gets what the budget has left this step
  and the rest in later steps; it samples only in the step it catches up.
- Prefix caching starts a new sequence with num_computed_tokens > 0 (blocks found by hash), except
  a sequence that asked for prompt logprobs and has not sampled yet: it needs the logits of every
  prompt position, so it computes them all. What its first admission found is its num_cached_tokens,
  and when it came its scheduled_at.
- Preemption by recompute frees a sequence's blocks and sets num_computed_tokens back to 0; its
  generated tokens stay, and it catches up again (prompt + outputs) when it is readmitted.

Per step: RUNNING sequences first, in arrival order; if the pool has no room for one, the
latest-arrived running sequence is preempted (possibly that one itself) until it fits. Then, if
nothing was preempted, WAITING sequences in FCFS order while budget, seats (max_num_seqs) and
blocks allow, stopping at the first that does not fit. num_computed_tokens is advanced when the
step is scheduled; after the model ran, `update_from_output` appends the sampled tokens, and the
engine calls `finish` for the sequences the output processor found finished.

Speculative decoding: a decoding sequence with `draft_token_ids` runs them after its last token in the
same entry (1 + d tokens, blocks allocated for all, the budget charged for all; drafts that do not fit
are dropped, never a reason to preempt). Only the last token counts as computed when scheduled; after
the model ran, `update_from_output` adds the drafts it accepted, so prefix-cache digests only ever
cover accepted tokens. Blocks past the accepted tokens stay in the table and are written again.

An embedding sequence (`embeds`) is a prompt and nothing after it: it is scheduled like any prompt (the
same budget, chunked, served by the prefix cache up to its last token, which is always computed), its
entry's `samples` marks the step that computes its last prompt token, and the engine finishes it in that
step with the pooled hidden state instead of a sampled token, so it never decodes.

n > 1: the request's sequence 0 (the leader) prefills alone; its siblings wait as FORK_PENDING.
When the leader samples for the first time they are forked from it (sharing its blocks, ref-counted)
and sample their first token from the leader's logits row; after that each runs on its own. Beam search
forks again later: `fork_beam` moves one running sibling onto another's tokens and blocks.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass

from backend.block_manager import Allocation, BlockManager
from backend.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig: {name} must be >= 1")


@dataclass(frozen=True, slots=True)
class ScheduledSequence:
    """One sequence's share of a step. Values are copied; `seq` is the live object."""

    seq: Sequence
    num_new_tokens: int
    start_position: int  # num_computed_tokens before this step: position of token_ids[0]
    token_ids: tuple[int, ...]  # the tokens computed this step
    block_table: tuple[int, ...]  # after this step's allocation
    samples: bool  # the logits of its last token are sampled (it caught up with num_tokens)
    forked: tuple[Sequence, ...]  # siblings forked this step: each samples from this entry's logits row
    draft_token_ids: tuple[int, ...] = ()  # token_ids[1:] when drafted: each of its rows is sampled

    @property
    def is_decode(self) -> bool:
        """One token past the computed ones, and its drafts. (How each row attends is the model
        runner's: by whether its token is a prompt token, backend/model_runner.py's StepLayout.)"""
        return self.num_new_tokens == 1 + len(self.draft_token_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]  # decode entries (`is_decode`) first, then the rest
    num_decode_seqs: int  # the decode entries
    blocks_to_copy: tuple[tuple[int, int], ...]  # copy-on-write (src, dst), to apply in order before the forward
    preempted: tuple[Sequence, ...]
    total_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def _order(seq: Sequence) -> tuple[int, int]:
    return (seq.arrival, seq.seq_index)


def _scores_prompt(seq: Sequence) -> bool:
    """A sequence that still owes its prompt logprobs must compute every prompt position: positions
    served from the prefix cache have no logits. (It still adds its blocks to the cache.)"""
    return seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.block_size != block_manager.block_size:
            raise ValueError("scheduler and block manager disagree on block_size")
        if block_manager.num_blocks * block_manager.block_size < config.max_model_len:
            # Otherwise a sequence alone in the pool could never fit and would preempt itself forever.
            raise ValueError(
                f"the KV pool holds {block_manager.num_blocks} x {block_manager.block_size} tokens, less than "
                f"max_model_len {config.max_model_len}: lower max_model_len or give the KV cache more memory"
            )
        self.config = config
        self.block_manager = block_manager
        self._waiting: deque[Sequence] = deque()  # leaders and preempted sequences, FCFS
        self._running: list[Sequence] = []  # sorted by (arrival, seq_index)
        self._requests: dict[str, list[Sequence]] = {}  # request id -> all its sequences, until all finish
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences without a seat: waiting ones and the siblings they will fork."""
        return sum(1 + len(s.fork_pending) for s in self._waiting)

    @property
    def num_free_seats(self) -> int:
        """Seats (max_num_seqs) no running sequence or sibling to be forked holds."""
        return self.config.max_num_seqs - sum(1 + len(s.fork_pending) for s in self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def add_request(self, seqs: list[Sequence]) -> None:
        """seqs[0] (the leader) joins the waiting queue; seqs[1:] wait for it to fork them."""
        leader = seqs[0]
        assert leader.request_id not in self._requests, f"duplicate request id {leader.request_id!r}"
        assert leader.num_prompt_tokens <= self.config.max_model_len, "prompt longer than max_model_len"
        assert len(seqs) <= self.config.max_num_seqs, "n larger than max_num_seqs could never be admitted"
        assert all(s.request_id == leader.request_id and s.prompt_token_ids == leader.prompt_token_ids for s in seqs)
        leader.status = SequenceStatus.WAITING
        leader.fork_pending = list(seqs[1:])
        for sibling in seqs[1:]:
            sibling.status = SequenceStatus.FORK_PENDING
            sibling.fork_leader = leader
        self._requests[leader.request_id] = list(seqs)
        self._waiting.append(leader)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        entries: list[ScheduledSequence] = []
        copies: list[tuple[int, int]] = []
        preempted: list[Sequence] = []

        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert num_new >= 1, f"{seq} is running with nothing to compute"
            drafts, seq.draft_token_ids = seq.draft_token_ids, ()
            alloc = None
            if drafts and seq.num_tokens - seq.num_computed_tokens == 1:
                drafts = drafts[: budget - 1]
                alloc = self.block_manager.allocate(seq, 1 + len(drafts)) if drafts else None
            if alloc is not None:
                num_new += len(drafts)
            else:
                drafts = ()
            while alloc is None and (alloc := self.block_manager.allocate(seq, num_new)) is None:
                victim = self._running.pop()  # the latest arrived; always at index >= i
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if alloc is None:
                break  # seq preempted itself: everything after it is gone too
            forked = self._commit(seq, num_new, alloc, entries, copies, drafts)
            budget -= num_new
            i += 1 + len(forked)  # forked siblings were inserted right after seq and have nothing to compute

        if not preempted:
            seats = sum(1 + len(s.fork_pending) for s in self._running)
            while self._waiting and budget > 0:
                seq = self._waiting[0]
                need_seats = 1 + len(seq.fork_pending)
                if seats + need_seats > self.config.max_num_seqs:
                    break
                assert seq.num_tokens <= self.config.max_model_len
                seq.num_computed_tokens = 0 if _scores_prompt(seq) else self.block_manager.match_prefix(seq)
                num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
                alloc = self.block_manager.allocate(seq, num_new)
                if alloc is None:  # give back the prefix hit; try again next step
                    self.block_manager.free(seq)
                    seq.num_computed_tokens = 0
                    break
                self._waiting.popleft()
                if seq.num_cached_tokens is None:  # its first admission (a readmission keeps both)
                    seq.num_cached_tokens = seq.num_computed_tokens
                    seq.scheduled_at = time.monotonic()
                seq.status = SequenceStatus.RUNNING
                bisect.insort(self._running, seq, key=_order)
                seats += need_seats
                self._commit(seq, num_new, alloc, entries, copies)
                budget -= num_new

        decodes = [e for e in entries if e.is_decode]
        return SchedulerOutput(
            scheduled=tuple(decodes + [e for e in entries if not e.is_decode]),
            num_decode_seqs=len(decodes),
            blocks_to_copy=tuple(copies),
            preempted=tuple(preempted),
            total_tokens=self.config.max_num_batched_tokens - budget,
        )

    def update_from_output(self, sampled: list[tuple[Sequence, tuple[int, ...]]]) -> None:
        """After the model ran: each sampling sequence gets its new tokens, its accepted drafts and the
        token after them; the accepted drafts' K/V was computed this step."""
        for seq, token_ids in sampled:
            for token_id in token_ids:
                seq.append_token(token_id)
            if len(token_ids) > 1:
                seq.num_computed_tokens += len(token_ids) - 1
                self.block_manager.mark_computed(seq)

    def fork_beam(self, seq: Sequence, parent: Sequence) -> None:
        """Beam search (backend/beam_search.py): seq, running, drops its blocks and tokens and takes those
        of parent, running beside it (its blocks shared, copy-on-write)."""
        assert seq.status is parent.status is SequenceStatus.RUNNING and seq.request_id == parent.request_id
        self.block_manager.free(seq)
        seq.output_token_ids = list(parent.output_token_ids)
        seq.num_computed_tokens = parent.num_computed_tokens
        self.block_manager.fork(parent, seq)

    def finish(self, seq: Sequence, cache: bool = True) -> list[Sequence]:
        """End seq (and, for a leader that has not forked yet, its pending siblings); free their
        blocks at once. Returns the sequences this call finished ([] if seq already was).
        cache=False: the KV content is not to be trusted (forward failed); forget its hashes."""
        if seq.is_finished:
            return []
        done = [seq, *seq.fork_pending]
        seq.fork_pending = []
        if seq.status is SequenceStatus.FORK_PENDING and seq.fork_leader is not None:
            seq.fork_leader.fork_pending.remove(seq)
        for s in done:
            if s.status is SequenceStatus.RUNNING:
                self._running.remove(s)
            elif s.status is SequenceStatus.WAITING:
                self._waiting.remove(s)
            self.block_manager.free(s, cache=cache)
            s.status = SequenceStatus.FINISHED
        seqs = self._requests.get(seq.request_id)
        if seqs is not None and all(s.is_finished for s in seqs):
            del self._requests[seq.request_id]
        return done

    def abort_request(self, request_id: str, cache: bool = True) -> list[Sequence]:
        """Finish every unfinished sequence of the request (waiting, running or fork-pending)."""
        done: list[Sequence] = []
        for seq in list(self._requests.get(request_id, ())):
            done.extend(self.finish(seq, cache=cache))
        return done

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)  # victims go latest-arrived first, so the earliest ends up in front
        self.num_preemptions += 1

    def _commit(
        self,
        seq: Sequence,
        num_new: int,
        alloc: Allocation,
        entries: list[ScheduledSequence],
        copies: list[tuple[int, int]],
        drafts: tuple[int, ...] = (),
    ) -> tuple[Sequence, ...]:
        """Advance seq by num_new tokens (drafts not counted), record its entry, fork its siblings if it
        samples first."""
        start = seq.num_computed_tokens
        token_ids = seq.token_slice(start, start + num_new - len(drafts)) + drafts
        seq.num_computed_tokens += num_new - len(drafts)
        self.block_manager.mark_computed(seq)
        samples = seq.num_computed_tokens == seq.num_tokens
        forked: tuple[Sequence, ...] = ()
        if samples and seq.fork_pending:
            assert seq.num_output_tokens == 0, "a leader forks at its first sample"
            forked = tuple(seq.fork_pending)
            seq.fork_pending = []
            for child in forked:
                self.block_manager.fork(seq, child)
                child.num_computed_tokens = seq.num_computed_tokens
                child.num_cached_tokens = seq.num_cached_tokens  # the prompt they share
                child.scheduled_at = seq.scheduled_at
                child.status = SequenceStatus.RUNNING
                bisect.insort(self._running, child, key=_order)
        copies.extend(alloc.copies)
        entries.append(
            ScheduledSequence(
                seq=seq,
                num_new_tokens=num_new,
                start_position=start,
                token_ids=token_ids,
                block_table=self.block_manager.block_table(seq),
                samples=samples,
                forked=forked,
                draft_token_ids=drafts,
            )
        )
        return forked
