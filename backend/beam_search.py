"""Beam search (vLLM's `use_beam_search`): one `BeamSearch` per request, its n sequences the live beams.

A beam-search request is n sequences admitted like any n > 1 request: the leader prefills, its siblings
are forked from it and share its blocks. Each step every live beam samples one row; the sampler reports
the 2n most likely tokens of each (their raw logprobs: `SamplingParams.num_top_logprobs`). `advance`
ranks the candidates, vLLM's way:
- each beam's 2n tokens extend it by their logprob; a stop token (EOS unless ignore_eos, or one of
  stop_token_ids) ends that extension as a finished hypothesis, once min_tokens allow it (before that it
  is no candidate at all);
- the n best other extensions by cumulative logprob are the next step's beams.
The beams then move into the n sequences: a beam stays in the sequence of the beam it extends, and a
second extension of one beam moves into a sequence whose beam has none, which drops its blocks and takes
the parent's (`Scheduler.fork_beam`: ref-counted, copy-on-write on the next write). The search ends when
the beams reach max_tokens or the context window (the live beams finish with "length"), or when no
extension is left; then the n best hypotheses, by cumulative logprob / (prompt + output tokens, a final
stop token not counted) ** length_penalty, are the request's n outputs, one final message each, ranked
best first. early_stopping (transformers' `early_stopping=True`) ends it as soon as n hypotheses have
finished with a stop token: the outputs are the n best of those.

Beams advance together: a step in which a live beam did not sample (it was preempted) advances none
of them (`advance` returns None and the engine has the others compute their last token again).
Nothing is streamed: each sequence's one message carries its whole output, and the leader's timings
(its queue and prefill, its first token: the search's). No torch here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from backend.detokenizer import IncrementalDetokenizer
from backend.sampler import SampledToken
from backend.sequence import Sequence
from protocol import FinishReason, StepOutput, TokenLogprobs
from tokenization.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A beam that ended: its output tokens (a final stop token included), their logprob entries."""

    token_ids: tuple[int, ...]
    entries: tuple[SampledToken, ...]
    cum_logprob: float
    finish_reason: FinishReason
    stop_reason: int | None  # the stop_token_ids entry that ended it (None for EOS and LENGTH)


@dataclass(frozen=True, slots=True)
class BeamChoice:
    """One beam of the next step: the sequence that carries it, the beam it extends, the token it adds."""

    seq: Sequence
    parent: Sequence  # the sequence of the beam it extends (seq itself, or the leader at the first step)
    token: SampledToken
    moves: bool  # seq holds another beam: it takes the parent's tokens and blocks first


@dataclass(frozen=True, slots=True)
class BeamStep:
    choices: tuple[BeamChoice, ...]  # the beams that go on
    dropped: tuple[Sequence, ...]  # sequences that carry no beam any more: to finish (all, when it ended)
    outputs: tuple[StepOutput, ...]  # when the search ended: the request's n final messages


@dataclass(slots=True)
class _Beam:
    cum_logprob: float
    entries: list[SampledToken]  # one per output token, trimmed to the request's logprobs


class BeamSearch:
    def __init__(
        self,
        request_id: str,
        seqs: list[Sequence],
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        max_model_len: int,
    ) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.params = params = seqs[0].params
        self._tokenizer = tokenizer
        self._stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self._width = params.n
        max_output = max_model_len - seqs[0].num_prompt_tokens
        self._max_output = max_output if params.max_tokens is None else min(params.max_tokens, max_output)
        # Before the first step every sequence holds the leader's beam (its siblings are forked from it).
        self._beams: dict[int, _Beam] = {seqs[0].seq_id: _Beam(0.0, [])}
        self._holders: dict[int, list[Sequence]] = {seqs[0].seq_id: list(seqs)}
        self._finished: list[Hypothesis] = []

    def advance(self, sampled: dict[Sequence, SampledToken]) -> BeamStep | None:
        """The step after every live beam sampled (`sampled`: each beam sequence's token and its top
        logprobs); None, changing nothing, when a live beam is missing."""
        parents = [s for s in self.seqs if s.seq_id in self._beams]
        if any(p not in sampled for p in parents):
            return None
        leader = self.seqs[0]
        if leader.first_token_at is None:
            leader.first_token_at = time.monotonic()
        width, k = self._width, self.params.logprobs
        candidates: list[tuple[float, Sequence, SampledToken]] = []
        for parent in parents:
            beam, row = self._beams[parent.seq_id], sampled[parent]
            num_output = parent.num_output_tokens + 1
            for token_id, logprob in zip(row.top_token_ids[: 2 * width], row.top_logprobs[: 2 * width]):
                entry = SampledToken(
                    token_id,
                    logprob,
                    row.top_token_ids[:k] if k else (),
                    row.top_logprobs[:k] if k else (),
                )
                cum = beam.cum_logprob + logprob
                if token_id in self._stops:
                    if num_output >= self.params.min_tokens:
                        self._finished.append(
                            Hypothesis(
                                (*parent.output_token_ids, token_id),
                                (*beam.entries, entry),
                                cum,
                                FinishReason.STOP,
                                token_id if token_id in self.params.stop_token_ids else None,
                            )
                        )
                    continue
                candidates.append((cum, parent, entry))
        if len(self._finished) > width:  # only the n best can be outputs (a finished score never changes)
            self._finished = sorted(self._finished, key=self._score, reverse=True)[:width]
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the beams' order, then the tokens' rank
        best = candidates[:width]
        num_output = parents[0].num_output_tokens + 1
        if self.params.early_stopping and len(self._finished) >= width:  # n finished: they are the outputs
            return BeamStep((), tuple(self.seqs_alive()), self._outputs())
        if not best or num_output >= self._max_output:
            for cum, parent, entry in best:
                beam = self._beams[parent.seq_id]
                self._finished.append(
                    Hypothesis(
                        (*parent.output_token_ids, entry.token_id),
                        (*beam.entries, entry),
                        cum,
                        FinishReason.LENGTH,
                        None,
                    )
                )
            return BeamStep((), tuple(self.seqs_alive()), self._outputs())
        return self._assign(best)

    def seqs_alive(self) -> list[Sequence]:
        """The sequences that hold a beam (all n until the search drops some)."""
        return [s for holders in self._holders.values() for s in holders]

    def abort_messages(self) -> list[StepOutput]:
        """A token-less last message for each of the request's n outputs (an abort ended the search)."""
        return [
            self._message(i, (), "", None, FinishReason.ABORT, None, i == self._width - 1) for i in range(self._width)
        ]

    def _assign(self, best: list[tuple[float, Sequence, SampledToken]]) -> BeamStep:
        """Moves the next beams into the sequences: a beam's first extensions stay in the sequences that
        hold it, the others move into sequences whose beam has no extension."""
        children: dict[int, list[tuple[float, Sequence, SampledToken]]] = {}
        for candidate in best:
            children.setdefault(candidate[1].seq_id, []).append(candidate)
        placed: list[tuple[Sequence, tuple[float, Sequence, SampledToken], bool]] = []
        spare: list[Sequence] = []
        moving: list[tuple[float, Sequence, SampledToken]] = []
        for parent_id, holders in self._holders.items():
            kids = children.get(parent_id, [])
            placed += [(seq, kid, False) for seq, kid in zip(holders, kids)]
            spare += holders[len(kids) :]
            moving += kids[len(holders) :]
        placed += [(spare.pop(0), kid, True) for kid in moving]
        self._beams = {
            seq.seq_id: _Beam(cum, [*self._beams[parent.seq_id].entries, entry])
            for seq, (cum, parent, entry), _ in placed
        }
        self._holders = {seq.seq_id: [seq] for seq, _, _ in placed}
        choices = tuple(BeamChoice(seq, parent, entry, moves) for seq, (_, parent, entry), moves in placed)
        return BeamStep(choices, tuple(spare), ())

    def _score(self, hyp: Hypothesis) -> float:
        length = self.seqs[0].num_prompt_tokens + len(hyp.token_ids)
        if hyp.finish_reason is FinishReason.STOP:
            length -= 1  # (vLLM's and transformers' rule: the stop token is not counted)
        return hyp.cum_logprob / (max(length, 1) ** self.params.length_penalty)

    def _outputs(self) -> tuple[StepOutput, ...]:
        ranked = sorted(self._finished, key=self._score, reverse=True)[: self._width]
        out = []
        for i, hyp in enumerate(ranked):
            text, token_texts = self._texts(hyp)
            logprobs = None
            if self.params.logprobs is not None:
                tokenizer = self._tokenizer
                logprobs = TokenLogprobs(
                    logprobs=tuple(e.logprob for e in hyp.entries),
                    token_texts=token_texts,
                    top_token_ids=tuple(e.top_token_ids for e in hyp.entries),
                    top_logprobs=tuple(e.top_logprobs for e in hyp.entries),
                    top_token_texts=tuple(tuple(tokenizer.token_text(t) for t in e.top_token_ids) for e in hyp.entries),
                )
            out.append(
                self._message(
                    i, hyp.token_ids, text, logprobs, hyp.finish_reason, hyp.stop_reason, i == len(ranked) - 1
                )
            )
        return tuple(out)

    def _texts(self, hyp: Hypothesis) -> tuple[str, tuple[str, ...]]:
        """The output's text and each token's, by the output processor's rule: a final stop token adds no
        text unless include_stop_str_in_output (what earlier tokens left unfinished still goes out), and
        what the detokenizer held at the end is the last token's text too."""
        detok = IncrementalDetokenizer(self._tokenizer, self.params.skip_special_tokens)
        *body, last = hyp.token_ids  # (a hypothesis has at least its one token)
        token_texts = [detok.add_token(t) for t in body]
        if hyp.finish_reason is FinishReason.STOP and not self.params.include_stop_str_in_output:
            held = detok.flush()
            token_texts.append(held + detok.add_token(last) + detok.flush())
            return "".join(token_texts[:-1]) + held, tuple(token_texts)
        token_texts.append(detok.add_token(last) + detok.flush())
        return "".join(token_texts), tuple(token_texts)

    def _message(
        self,
        index: int,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: TokenLogprobs | None,
        finish: FinishReason,
        stop_reason: int | None,
        request_finished: bool,
    ) -> StepOutput:
        seq = self.seqs[index]
        return StepOutput(
            request_id=self.request_id,
            seq_index=index,
            step=0,
            token_ids=token_ids,
            text_delta=text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(token_ids),
            num_cached_tokens=self.seqs[0].num_cached_tokens or 0,
            request_finished=request_finished,
            timings=self.seqs[0].timings(time.monotonic()),  # (the beams share the leader's phases)
        )
