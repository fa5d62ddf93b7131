"""The chat template sandbox: chat_template_kwargs add variables but never replace what the request's own
fields set (messages, tools, add_generation_prompt, the special tokens), with a 400 naming the key."""

from __future__ import annotations

import pytest

from openai_frontend.chat_template import render_chat
from openai_frontend.errors import InvalidRequest
from tests.fake_engine import FAKE_MODEL

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"])
def test_template_kwargs_cannot_replace_the_requests_own_variables(key):
    with pytest.raises(InvalidRequest) as refused:
        render_chat(FAKE_MODEL, MESSAGES, template_kwargs={key: "OVERRIDDEN"})
    assert refused.value.param == f"chat_template_kwargs.{key}"


def test_other_template_kwargs_still_reach_the_template():
    plain = render_chat(FAKE_MODEL, MESSAGES)
    assert render_chat(FAKE_MODEL, MESSAGES, template_kwargs={"greeting": "Hello"}) == plain
    assert "OVERRIDDEN" not in plain and "Hi" in plain
