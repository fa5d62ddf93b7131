"""benchmarks/serve_bench.py pools a level's rounds: what ran between them is not counted."""

import pytest

from benchmarks.serve_bench import RequestRecord, summarize, summarize_rounds


def record(sent: float, first: float, last: float, tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(sent=sent, first=first, last=last, tokens=tokens, error=error)


def test_rounds_add_their_own_durations_and_pool_latencies():
    first = [record(0.0, 0.1, 1.1, 11), record(0.5, 0.7, 2.0, 14)]  # spans 0.0 .. 2.0
    second = [record(100.0, 100.2, 103.0, 15)]  # 97 s later (the other path ran meanwhile): spans 3.0
    level = summarize_rounds(8, [first, second])
    assert level.seconds == pytest.approx(5.0)
    assert level.output_tokens == 40
    assert level.output_tok_s == pytest.approx(8.0)
    assert level.requests == 3 and level.errors == 0
    assert level.ttft_ms_p50 == pytest.approx(200.0)  # of 100, 200 and 200 ms
    # One round is what summarize() has always measured: first send to last token.
    assert summarize(8, first).seconds == pytest.approx(2.0)
    assert summarize(8, first).output_tok_s == pytest.approx(12.5)


def test_a_failed_request_counts_as_an_error_not_as_tokens():
    failed = record(0.0, 0.1, 0.2, 5, error="boom")
    level = summarize_rounds(1, [[record(0.0, 0.5, 1.0, 6)], [failed]])
    assert level.errors == 1 and level.output_tokens == 6
