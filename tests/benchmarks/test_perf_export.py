"""perf_analyzer's profile export read back (scripts/perf_tools.py), and serve_bench's perf_analyzer level
(benchmarks/serve_bench.py --perf-analyzer) with a stand-in for the perf_analyzer binary."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from benchmarks import serve_bench
from protocol import SamplingParams
from scripts import perf_tools

MS = 1_000_000  # ns


def export_json(*experiments: tuple[int, list[dict]]) -> str:
    return json.dumps(
        {"experiments": [{"experiment": {"mode": "concurrency", "value": c}, "requests": rs} for c, rs in experiments]}
    )


def request(sent_ms: int, responses_ms: list[int], num_output_tokens: int | None = None) -> dict:
    outputs = [{"step": i} for i in range(len(responses_ms))]
    if num_output_tokens is not None and outputs:
        outputs[-1]["num_output_tokens"] = num_output_tokens
    return {
        "timestamp": sent_ms * MS,
        "response_timestamps": [t * MS for t in responses_ms],
        "response_outputs": outputs,
    }


def test_exported_requests_skip_requests_without_a_response_and_count_tokens_from_the_last(tmp_path):
    path = tmp_path / "export.json"
    path.write_text(
        export_json(
            (1, [request(0, [100, 110, 120], num_output_tokens=4), request(200, [])]),
            (2, [request(0, [50, 60])]),  # no num_output_tokens: one token a response
        )
    )
    (c1, first), (c2, second) = perf_tools.exported_requests(path)
    assert (c1, c2) == (1, 2)
    assert first == [perf_tools.ExportedRequest(0, (100 * MS, 110 * MS, 120 * MS), 4)]
    assert second == [perf_tools.ExportedRequest(0, (50 * MS, 60 * MS), 2)]


def test_summarize_pa_export_times_from_send_and_responses(tmp_path):
    path = tmp_path / "export.json"
    # Two requests of 3 tokens: TTFT 100 and 300 ms, ITL (last - first) / 2 = 10 and 20 ms; 6 tokens in 500 ms.
    path.write_text(export_json((2, [request(0, [100, 110, 120], 3), request(100, [400, 420, 440], 3)])))
    (row,) = perf_tools.summarize_pa_export(path)
    assert row["concurrency"] == 2 and row["requests"] == 2
    assert row["output_token_throughput"] == pytest.approx(6 / 0.44)
    assert row["ttft_ms_p50"] == pytest.approx(200.0)
    assert row["itl_ms_p50"] == pytest.approx(15.0)
    assert row["latency_ms_p50"] == pytest.approx((120 + 340) / 2)


def test_perf_analyzer_level_sends_each_prompt_once_and_reads_its_export(tmp_path, monkeypatch):
    seen: dict = {}

    def fake_perf_analyzer(cmd, **kwargs):
        seen["cmd"] = cmd

        def value(flag: str) -> str:
            return cmd[cmd.index(flag) + 1]

        seen["input"] = json.loads(Path(value("--input-data")).read_text())["data"]
        Path(value("--profile-export-file")).write_text(
            export_json((int(value("--concurrency-range")), [request(10, [20, 30], 2), request(15, [40, 45, 50], 3)]))
        )
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(serve_bench.subprocess, "run", fake_perf_analyzer)
    monkeypatch.setattr(perf_tools, "tools_env", dict)  # (it asks the tools' venv, which a fresh clone lacks)
    args = argparse.Namespace(model="m", max_tokens=7)
    prompts = ["one", "two", "three"]
    records = serve_bench.perf_analyzer_level(args, "127.0.0.1:1", prompts, 2, tmp_path)

    cmd = seen["cmd"]
    assert cmd[0] == str(perf_tools.perf_analyzer_binary())
    assert cmd[cmd.index("-u") + 1] == "127.0.0.1:1" and "--streaming" in cmd
    assert cmd[cmd.index("--concurrency-range") + 1] == "2"
    # c requests fewer than prompts: one sent past the count finds a fresh prompt, not a cached one.
    assert cmd[cmd.index("--request-count") + 1] == "1"
    assert [entry["text_input"] for entry in seen["input"]] == [[p] for p in prompts]
    for entry in seen["input"]:
        params = SamplingParams.from_json(entry["sampling_params"][0])
        assert params.max_tokens == 7 and params.ignore_eos
    assert [(r.sent, r.first, r.last, r.tokens) for r in records] == [
        (pytest.approx(0.010), pytest.approx(0.020), pytest.approx(0.030), 2),
        (pytest.approx(0.015), pytest.approx(0.040), pytest.approx(0.050), 3),
    ]


def test_perf_analyzer_level_fails_loudly_without_an_export(tmp_path, monkeypatch):
    monkeypatch.setattr(
        serve_bench.subprocess, "run", lambda cmd, **kwargs: subprocess.CompletedProcess(cmd, 0, "ran", "")
    )
    monkeypatch.setattr(perf_tools, "tools_env", dict)
    with pytest.raises(RuntimeError, match="perf_analyzer failed at concurrency 1"):
        serve_bench.perf_analyzer_level(argparse.Namespace(model="m", max_tokens=4), "h:1", ["a", "b"], 1, tmp_path)
