"""The output processor alone, replaying sampled tokens step by step (as vLLM's output-processor tests
do): no scheduler, no model. The real tokenizer; the tokens are appended first, as the scheduler does."""

from __future__ import annotations

from backend.model_runner import RunnerOutput
from backend.output_processor import OutputProcessor
from backend.sampler import SampledToken
from backend.sequence import Sequence
from protocol import FinishReason, SamplingParams, StepOutput
from tests.engine_helpers import smollm2_tokenizer

TOK = smollm2_tokenizer()
EOS = TOK.eos_token_ids[0]


def request(request_id: str, params: SamplingParams, prompt: str = "Hi") -> tuple[OutputProcessor, list[Sequence]]:
    processor = OutputProcessor(TOK, max_model_len=64)
    seqs = [Sequence(i, request_id, i, tuple(TOK.encode(prompt)), params, 0) for i in range(params.n)]
    processor.add_request(request_id, seqs)
    return processor, seqs


def step(processor: OutputProcessor, tokens: list[tuple[Sequence, int]]) -> tuple[list[StepOutput], list[Sequence]]:
    for seq, token_id in tokens:  # the scheduler's update_from_output
        seq.append_token(token_id)
    return processor.process(RunnerOutput(sampled=[(seq, (SampledToken(t),)) for seq, t in tokens]))


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def test_siblings_finishing_in_one_step_each_keep_their_last_tokens():
    processor, (a, b) = request("r", SamplingParams(n=2, max_tokens=3))
    first = ids(" one two three")
    messages, finished = step(processor, [(a, first[0]), (b, first[0])])
    assert finished == [] and [m.step for m in messages] == [0, 0]
    messages, finished = step(processor, [(a, first[1]), (b, EOS)])
    assert finished == [b] and messages[1].finish_reason is FinishReason.STOP and messages[1].token_ids == (EOS,)
    assert not messages[1].request_finished
    messages, finished = step(processor, [(a, first[2])])
    assert finished == [a] and messages[0].finish_reason is FinishReason.LENGTH and messages[0].request_finished
    assert messages[0].token_ids == (first[2],) and messages[0].num_output_tokens == 3
    assert "r" not in processor.requests


def test_a_stop_string_across_deltas_is_held_back_then_cut():
    processor, (seq,) = request("r", SamplingParams(max_tokens=20, stop=("lo wo",)))
    texts = []
    for token_id in ids("Hello world again"):
        messages, finished = step(processor, [(seq, token_id)])
        texts.append(messages[0].text_delta)
        if finished:
            break
    assert "".join(texts) == "Hel" and messages[0].stop_reason == "lo wo"
    assert messages[0].finish_reason is FinishReason.STOP and finished == [seq]
    processor, (seq,) = request("r2", SamplingParams(max_tokens=20, stop=("lo wo",), include_stop_str_in_output=True))
    texts = [step(processor, [(seq, t)])[0][0].text_delta for t in ids("Hello wo")]
    assert "".join(texts) == "Hello wo"


def test_min_tokens_lets_eos_pass_until_it_is_reached():
    processor, (seq,) = request("r", SamplingParams(max_tokens=10, min_tokens=2))
    messages, finished = step(processor, [(seq, EOS)])
    assert not finished and messages[0].finish_reason is None  # one token: EOS does not stop yet
    messages, finished = step(processor, [(seq, EOS)])
    assert finished == [seq] and messages[0].finish_reason is FinishReason.STOP
    assert [m.num_output_tokens for m in messages] == [2]


def test_an_abort_ends_every_unfinished_sibling_once():
    processor, seqs = request("r", SamplingParams(n=3, max_tokens=5))
    step(processor, [(s, ids(" x")[0]) for s in seqs])
    messages = processor.abort_sequences(seqs)
    assert [m.finish_reason for m in messages] == [FinishReason.ABORT] * 3
    assert [m.step for m in messages] == [1, 1, 1] and [m.request_finished for m in messages] == [False, False, True]
