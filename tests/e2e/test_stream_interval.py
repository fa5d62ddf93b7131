"""`stream_interval` on the real servers (config.pbtxt; backend/coalescing.StreamInterval): the same
streams as the shared server's (stream_interval 1), in fewer SSE chunks, the first token alone."""

from __future__ import annotations

import pytest
from openai import OpenAI

from scripts.servers import DEFAULT_MODEL, copy_model_repository
from tests.e2e.helpers import running_servers

pytestmark = pytest.mark.e2e

INTERVAL = 4


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    repository = copy_model_repository(tmp_path_factory.mktemp("interval"), stream_interval=str(INTERVAL))
    with running_servers(repository, "stream-interval") as (_, frontend):
        yield f"{frontend.url}/v1"


def stream(base_url: str) -> tuple[dict[int, list], dict[int, str], object]:
    """Per choice: the tokens' logprob entries of each chunk, and the text; plus the usage."""
    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    chunks = client.completions.create(
        model=DEFAULT_MODEL, prompt="The three primary colors are", max_tokens=14, n=2, temperature=0.0,
        logprobs=1, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    per_chunk: dict[int, list] = {0: [], 1: []}
    text: dict[int, str] = {0: "", 1: ""}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.text
            if choice.logprobs is not None and choice.logprobs.tokens:
                per_chunk[choice.index].append(list(zip(choice.logprobs.tokens, choice.logprobs.token_logprobs)))
    return per_chunk, text, usage


def test_grouped_streams_equal_step_by_step_ones(servers, grouped):
    one_by_one, text_1, usage_1 = stream(servers.base_url)
    in_groups, text_4, usage_4 = stream(grouped)
    assert text_4 == text_1 and usage_4 == usage_1 and usage_4.completion_tokens == 28
    for index in (0, 1):
        assert [t for c in in_groups[index] for t, _ in c] == [t for c in one_by_one[index] for t, _ in c]
        lp_1 = [lp for c in one_by_one[index] for _, lp in c]
        lp_4 = [lp for c in in_groups[index] for _, lp in c]
        assert lp_4 == pytest.approx(lp_1, abs=1e-4)
        sizes = [len(c) for c in in_groups[index]]
        assert sizes[0] == 1 and max(sizes) == INTERVAL and len(sizes) < len(one_by_one[index]) == 14
