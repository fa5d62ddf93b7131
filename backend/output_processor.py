"""Turns the tokens sampled in one engine step into the per-step messages (StepOutput).

This is the one place where deltas are computed: the new token ids, the text they add (through
the sequence's own incremental detokenizer and stop-string matcher), their logprobs, and the
cumulative counts, all copied into a frozen StepOutput. Later layers carry these values unchanged.

Each sequence that got a token gets its own message, so siblings that finish in the same step each
keep their own last tokens (invariant 4 of docs/contract.md), and finish_reason is decided here exactly
once. A step may bring a sequence several tokens (accepted drafts: backend/speculation.py); they go in
its one message, each judged in turn exactly as it would be alone, and a token that finishes the
sequence drops the ones after it. An embedding sequence gets exactly one message, its last, carrying its
vector and no tokens. A sequence's last message carries its timings (queued, prefill, decode), for which
the clock is read once at its first token and once at its finish. It changes no other scheduling state:
the scheduler has appended the step's tokens before, and frees the sequences this returns as finished
after (backend/engine.py's step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from backend.detokenizer import IncrementalDetokenizer
from backend.model_runner import PromptScores, RunnerOutput
from backend.sampler import SampledToken
from backend.sequence import Sequence
from protocol import FinishReason, PromptLogprobs, RequestTimings, StepOutput, TokenLogprobs
from tokenization.stop_strings import StopStringMatcher
from tokenization.tokenizer import Tokenizer


@dataclass(slots=True)
class RequestState:
    """The small parent of a request's n sequences: it only tracks which are still alive."""

    request_id: str
    sequences: list[Sequence]
    num_unfinished: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request_id: str, sequences: list[Sequence]) -> None:
        for seq in sequences:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
            seq.stop_matcher = (
                StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output) if seq.params.stop else None
            )
        self.requests[request_id] = RequestState(request_id, list(sequences))

    def process(self, output: RunnerOutput) -> tuple[list[StepOutput], list[Sequence]]:
        """One message per sequence that got tokens, in the order they were sampled, and the sequences
        that finished (for the scheduler to free). The tokens are already appended to their sequences;
        tokens past the one that finished a sequence are dropped from it. Prompt scores are kept on their
        sequence until it samples: its first message carries them all."""
        for chunk in output.prompt_scores:
            self._keep_prompt_scores(chunk)
        messages = [self._on_tokens(seq, toks) for seq, toks in output.sampled]
        finished = [seq for (seq, _), m in zip(output.sampled, messages) if m.finished]
        for seq, vector in output.embeddings:  # its prompt is computed: that is all it asked for
            messages.append(self._finish_message(seq, (), "", None, FinishReason.STOP, None, embedding=vector))
            finished.append(seq)
        return messages, finished

    def abort_sequences(self, sequences: list[Sequence]) -> list[StepOutput]:
        """A last, token-less message for each sequence an abort ended (the scheduler freed them)."""
        return [self._finish_message(seq, (), "", None, FinishReason.ABORT, None) for seq in sequences]

    def drop_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    @staticmethod
    def _keep_prompt_scores(chunk: PromptScores) -> None:
        seq = chunk.seq
        if seq.prompt_scores is None:
            seq.prompt_scores = [None] * (seq.num_prompt_tokens - 1)
        # By position: a sequence preempted mid-prompt scores the same positions again when it recomputes.
        seq.prompt_scores[chunk.first_position - 1 : chunk.first_position - 1 + len(chunk.scores)] = chunk.scores

    def _prompt_logprobs(self, seq: Sequence) -> PromptLogprobs:
        """The request's prompt logprobs, built once from its leader's scores (siblings share them)."""
        leader = seq.fork_leader or seq
        if leader.prompt_logprobs is None:
            scores = leader.prompt_scores or []
            assert len(scores) == leader.num_prompt_tokens - 1 and all(s is not None for s in scores), (
                "a sequence sampled before every prompt token was scored"
            )
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=False)
            texts = [detok.add_token(t) for t in leader.prompt_token_ids]
            texts[-1] += detok.flush()
            leader.prompt_logprobs = PromptLogprobs(
                token_ids=leader.prompt_token_ids,
                token_texts=tuple(texts),
                logprobs=tuple(s.logprob for s in scores),
                ranks=tuple(s.rank for s in scores),
                top_token_ids=tuple(s.top_token_ids for s in scores),
                top_logprobs=tuple(s.top_logprobs for s in scores),
                top_token_texts=tuple(tuple(self.tokenizer.token_text(t) for t in s.top_token_ids) for s in scores),
            )
            leader.prompt_scores = None
        return leader.prompt_logprobs

    def _on_tokens(self, seq: Sequence, toks: tuple[SampledToken, ...]) -> StepOutput:
        """The step's message of seq: its new tokens (several when drafted tokens were accepted), each
        judged in turn as if it came alone; a token that finishes the sequence drops those after it."""
        before = seq.num_output_tokens - len(toks)
        assert tuple(seq.output_token_ids[before:]) == tuple(t.token_id for t in toks), "the scheduler appends first"
        if before == 0:
            seq.first_token_at = time.monotonic()
        texts: list[str] = []
        token_texts: list[str] = []
        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        for i, tok in enumerate(toks):
            finish, stop_reason, text, token_text = self._judge(seq, tok, before + i + 1)
            texts.append(text)
            token_texts.append(token_text)
            if finish is not None:
                break
        kept = toks[: len(texts)]
        if len(kept) < len(toks):
            seq.drop_output_after(before + len(kept))
        params = seq.params
        logprobs = None
        if params.logprobs is not None:
            logprobs = TokenLogprobs(
                logprobs=tuple(t.logprob for t in kept),
                token_texts=tuple(token_texts),
                top_token_ids=tuple(t.top_token_ids for t in kept),
                top_logprobs=tuple(t.top_logprobs for t in kept),
                top_token_texts=tuple(tuple(self.tokenizer.token_text(i) for i in t.top_token_ids) for t in kept),
            )
        prompt_logprobs = None
        if params.prompt_logprobs is not None and seq.next_step == 0:
            prompt_logprobs = self._prompt_logprobs(seq)
        token_ids = tuple(t.token_id for t in kept)
        text = "".join(texts)
        if finish is not None:
            return self._finish_message(seq, token_ids, text, logprobs, finish, stop_reason, prompt_logprobs)
        return self._message(seq, token_ids, text, logprobs, None, None, False, prompt_logprobs)

    def _judge(
        self, seq: Sequence, tok: SampledToken, num_output: int
    ) -> tuple[FinishReason | None, str | int | None, str, str]:
        """One new token, the sequence's `num_output`-th: (finish, stop reason, the text it releases, its
        own text for its logprob entry); advances the grammar, detokenizer and stop-string matcher."""
        params = seq.params
        may_stop = num_output >= params.min_tokens

        grammar_ended = grammar_broken = False
        if seq.grammar is not None:
            # The sampler only picks allowed tokens; a refusal would be a bug, and the sequence ends
            # ("abort") rather than go on outside its grammar.
            grammar_broken = not seq.grammar.accept(tok.token_id)
            grammar_ended = seq.grammar.is_terminated

        finish: FinishReason | None = None
        stop_reason: str | int | None = None
        stop_token = False  # the token ended the sequence as EOS or one of stop_token_ids
        if grammar_broken:
            finish = FinishReason.ABORT
        elif may_stop and not params.ignore_eos and tok.token_id in self.eos_token_ids:
            finish, stop_token = FinishReason.STOP, True
        elif may_stop and tok.token_id in params.stop_token_ids:
            finish, stop_reason, stop_token = FinishReason.STOP, tok.token_id, True
        elif grammar_ended:  # its EOS was accepted: nothing may follow, whatever min_tokens or ignore_eos say
            finish = FinishReason.STOP
        elif (
            params.max_tokens is not None and num_output >= params.max_tokens
        ) or seq.num_prompt_tokens + num_output >= self.max_model_len:
            finish = FinishReason.LENGTH

        if stop_token and not params.include_stop_str_in_output:
            # vLLM's rule: the token that stopped the sequence adds no text (its logprob entry keeps its
            # own); what earlier tokens left unfinished still goes out.
            text = seq.detokenizer.flush()
            token_text = text + seq.detokenizer.add_token(tok.token_id) + seq.detokenizer.flush()
        else:
            token_text = seq.detokenizer.add_token(tok.token_id)
            if finish is not None:
                # What the detokenizer still held (an unfinished character) is this last token's text
                # too, so the logprob tokens of a sequence join to its text.
                token_text += seq.detokenizer.flush()
            text = token_text
        if seq.stop_matcher is not None:
            matched = None
            if may_stop:  # before min_tokens the text bypasses the matcher
                text, matched = seq.stop_matcher.feed(text)
            if matched is not None:
                finish, stop_reason = FinishReason.STOP, matched
            elif finish is not None:
                text += seq.stop_matcher.flush()
        return finish, stop_reason, text, token_text

    def _finish_message(
        self,
        seq: Sequence,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: TokenLogprobs | None,
        finish: FinishReason,
        stop_reason: str | int | None,
        prompt_logprobs: PromptLogprobs | None = None,
        embedding: tuple[float, ...] | None = None,
    ) -> StepOutput:
        seq.finish_reason = finish
        timings = seq.timings(time.monotonic())
        state = self.requests[seq.request_id]
        state.num_unfinished -= 1
        request_finished = state.num_unfinished == 0
        if request_finished:
            del self.requests[seq.request_id]
        return self._message(
            seq, token_ids, text, logprobs, finish, stop_reason, request_finished, prompt_logprobs, embedding, timings
        )

    @staticmethod
    def _message(
        seq: Sequence,
        token_ids: tuple[int, ...],
        text: str,
        logprobs: TokenLogprobs | None,
        finish: FinishReason | None,
        stop_reason: str | int | None,
        request_finished: bool,
        prompt_logprobs: PromptLogprobs | None = None,
        embedding: tuple[float, ...] | None = None,
        timings: RequestTimings | None = None,
    ) -> StepOutput:
        step = seq.next_step
        seq.next_step += 1
        return StepOutput(
            request_id=seq.request_id,
            seq_index=seq.seq_index,
            step=step,
            token_ids=token_ids,
            text_delta=text,
            logprobs=logprobs,
            finish_reason=finish,
            stop_reason=stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
            request_finished=request_finished,
            prompt_logprobs=prompt_logprobs,
            embedding=embedding,
            timings=timings,
        )
