"""genai-perf profile against the real frontend: every request it sent is in its export, none failed."""

from __future__ import annotations

import json
import subprocess

import pytest

from scripts import perf_tools


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_genai_perf_profile(servers, tmp_path, endpoint) -> None:
    perf_tools.install(tokenizer=True)  # first use: creates .tools/ (about a minute)
    requests, output_tokens = 4, 8
    cmd = perf_tools.genai_perf_command(
        servers.model,
        servers.frontend.url,
        endpoint,
        concurrency=2,
        requests=requests,
        input_tokens=32,
        output_tokens=output_tokens,
        tokenizer=perf_tools.TOKENIZER_DIR,
        artifact_dir=tmp_path / "artifacts",
    )
    result = subprocess.run(cmd, env=perf_tools.tools_env(), cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    metrics_file, raw_file = perf_tools.genai_perf_export_files(tmp_path / "artifacts")
    # perf_analyzer's raw export: every request, each streamed to the end with no error event.
    (experiment,) = json.loads(raw_file.read_text())["experiments"]
    assert experiment["experiment"] == {"mode": "concurrency", "value": 2}
    assert len(experiment["requests"]) == requests
    for request in experiment["requests"]:
        payload = json.loads(request["request_inputs"]["payload"])
        assert payload["stream"] is True and payload["ignore_eos"] is True and payload["max_tokens"] == output_tokens
        # One read may hold several SSE events, or part of one: join the reads, then split the events.
        stream = "".join(o["response"] for o in request["response_outputs"])
        events = [e.strip() for e in stream.split("\n\n") if e.strip()]
        assert events and events[-1] == "data: [DONE]", events[-3:]
        assert all(e.startswith("data: ") for e in events), [e for e in events if not e.startswith("data: ")]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c]
        tokens = [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
        assert len(tokens) == output_tokens  # one chunk per token, max_tokens of them (ignore_eos)
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"

    # genai-perf's own metrics: all requests counted.
    metrics = json.loads(metrics_file.read_text())
    assert metrics["request_count"]["avg"] == requests
    assert metrics["time_to_first_token"]["avg"] > 0
    assert metrics["output_token_throughput"]["avg"] > 0
    row = perf_tools.read_genai_perf_export(tmp_path / "artifacts")
    assert row["requests"] == requests
