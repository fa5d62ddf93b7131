"""`make bench-score`'s served side against the shared real servers: lm-eval's loglikelihood requests
(batched token-id prompts, echo, logprobs), each prompt's token logprobs in order, as a single
prompt's own request returns them."""

from __future__ import annotations

import httpx

from benchmarks.score_bench import largest_difference, score_served

PROMPTS = [[504, 3575, 282, 4649, 314], [1780, 2113, 253, 655], [28, 29, 30, 31, 32, 33], [7042, 314]]


async def test_batched_scoring_returns_each_prompts_logprobs_in_order(servers):
    seconds, scored = await score_served(servers.frontend.url, servers.model, PROMPTS, batch=3, concurrency=2)
    assert seconds > 0 and [len(s) for s in scored] == [len(p) for p in PROMPTS]
    async with httpx.AsyncClient(base_url=servers.frontend.url, timeout=60) as http:
        for prompt, got in zip(PROMPTS, scored, strict=True):
            body = {"model": servers.model, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1}
            alone = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
            expected = alone["token_logprobs"][: len(prompt)]
            assert got[0] is None and expected[0] is None
            assert largest_difference([got], [expected])[0] < 1e-4, (got, expected)
