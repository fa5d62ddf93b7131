"""SamplingParams bounds what a client chooses and the engine pays for at every step: each list and string
size has a limit, and past it the request is refused with the field named (OpenAI's 300 for logit_bias)."""

from __future__ import annotations

import pytest

from protocol import InvalidRequestError, SamplingParams
from protocol import sampling as s


@pytest.mark.parametrize(
    "field, at_limit, past_limit",
    [
        (
            "logit_bias",
            {str(t): 1.0 for t in range(s.MAX_LOGIT_BIAS)},
            {str(t): 1.0 for t in range(s.MAX_LOGIT_BIAS + 1)},
        ),
        ("allowed_token_ids", list(range(s.MAX_ALLOWED_TOKEN_IDS)), list(range(s.MAX_ALLOWED_TOKEN_IDS + 1))),
        ("stop_token_ids", list(range(s.MAX_STOP_TOKEN_IDS)), list(range(s.MAX_STOP_TOKEN_IDS + 1))),
        ("stop", ["x"] * s.MAX_STOP_STRINGS, ["x"] * (s.MAX_STOP_STRINGS + 1)),
        ("stop", ["x" * s.MAX_STOP_STRING_CHARS], ["x" * (s.MAX_STOP_STRING_CHARS + 1)]),
        ("bad_words", ["w"] * s.MAX_BAD_WORDS, ["w"] * (s.MAX_BAD_WORDS + 1)),
        ("bad_words", ["w" * s.MAX_BAD_WORD_CHARS], ["w" * (s.MAX_BAD_WORD_CHARS + 1)]),
    ],
)
def test_each_size_has_a_bound_that_names_its_field(field, at_limit, past_limit):
    SamplingParams.from_dict({field: at_limit})
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_dict({field: past_limit})
    assert refused.value.param == field and "at most" in refused.value.message


@pytest.mark.parametrize("field", ["allowed_token_ids", "stop_token_ids"])
@pytest.mark.parametrize("token_id", [-1, 2**31, 2**32 + 5, 2**64, True])
def test_token_ids_are_refused_outside_what_the_wire_carries(field, token_id):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_dict({field: [token_id]})
    assert refused.value.param == field


@pytest.mark.parametrize("token_id", ["-1", str(2**31), str(2**64)])
def test_logit_bias_token_ids_too(token_id):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_dict({"logit_bias": {token_id: 1.0}})
    assert refused.value.param == "logit_bias"


def test_sampling_params_nested_past_the_parsers_stack_are_refused_not_raised():
    deep = '{"structured_outputs": {"json": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams.from_json(deep)
    assert refused.value.param == "sampling_params"
    schema = "[" * 100_000 + "]" * 100_000
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({"structured_outputs": {"json": schema}})
