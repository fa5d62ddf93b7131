"""vLLM's bad_words (backend/bad_words.py): the token sequences of a word, and the tokens they ban."""

from __future__ import annotations

import pytest
import torch

from backend.bad_words import bad_words_token_ids, banned_next_tokens
from backend.sampler import Sampler, SamplingRow
from protocol import SamplingParams
from tokenization.model_files import load_tokenizer

TOKENIZER = load_tokenizer("smollm2")


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def test_a_word_is_banned_as_written_and_after_a_space():
    (bare, spaced) = bad_words_token_ids(["Paris"], encode)
    assert bare == tuple(encode("Paris")) and spaced == tuple(encode(" Paris")) and bare != spaced
    # leading spaces are the rule's, not the word's
    assert bad_words_token_ids(["  Paris"], encode) == (bare, spaced)


def test_the_spaced_form_is_kept_only_when_it_is_another_word_of_the_same_length():
    def fake(text: str) -> list[int]:
        return {"ab": [1, 2], " ab": [3, 2], "cd": [4], " cd": [5, 4]}[text]

    assert bad_words_token_ids(["ab", "cd"], fake) == ((1, 2), (3, 2), (4,))


@pytest.mark.parametrize(
    "output, banned",
    [
        ((), [9]),  # one-token words always; longer ones need their prefix in the output
        ((1,), [9, 3]),
        ((7, 1), [9, 3]),
        ((1, 2), [9, 5]),
        ((0, 1, 2), [9, 5]),
        ((2, 3, 1), [9, 3]),
        ((2, 1, 3), [9]),
    ],
)
def test_the_next_token_is_banned_where_it_completes_a_word(output, banned):
    bad = ((9,), (1, 3), (1, 2, 5))
    assert banned_next_tokens(bad, output) == banned


def test_the_sampler_never_completes_a_bad_word():
    logits = torch.zeros(1, 12)
    logits[0, 3], logits[0, 4] = 9.0, 8.0  # 3 is the best token, 4 the next
    params = SamplingParams(temperature=0.0)

    def sample(output, bad):
        return Sampler().sample(logits, [SamplingRow(params, None, (5,), output, (0,), bad)])[0].token_id

    assert sample((1,), ((1, 3),)) == 4  # 1 then 3 would spell the word
    assert sample((2,), ((1, 3),)) == 3  # another prefix: allowed
    assert sample((), ((3,),)) == 4
