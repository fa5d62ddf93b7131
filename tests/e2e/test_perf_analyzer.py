"""`make perf`'s input data is valid for the model: perf_analyzer --streaming runs it against the real Triton."""

from __future__ import annotations

import json
import subprocess

import pytest

from protocol import SamplingParams
from scripts import perf_tools
from scripts.servers import MODEL_REPOSITORY

PERF_INPUT = perf_tools.PERF_INPUT


def test_perf_input_matches_the_wire_contract() -> None:
    """Fast: the file's inputs are model inputs, and its sampling_params parse as the model parses them."""
    data = json.loads(PERF_INPUT.read_text())["data"]
    assert data
    config = (MODEL_REPOSITORY / "smollm2-135m-instruct" / "config.pbtxt").read_text()
    for entry in data:
        assert set(entry) == {"text_input", "sampling_params"}
        for name, values in entry.items():
            assert f'name: "{name}"' in config
            assert isinstance(values, list) and len(values) == 1 and isinstance(values[0], str)
        params = SamplingParams.from_json(entry["sampling_params"][0])
        assert params.ignore_eos and params.max_tokens == 64


@pytest.mark.slow
def test_perf_analyzer_streams_the_input_data(servers, tmp_path) -> None:
    perf_tools.install(tokenizer=False)  # first use: creates .tools/ (about a minute)
    requests = 2
    export = tmp_path / "export.json"
    cmd = perf_tools.perf_analyzer_command(
        servers.model,
        servers.triton.grpc_url,
        concurrency=2,
        requests=requests,
        input_data=PERF_INPUT,
        export=export,
        csv=tmp_path / "pa.csv",
    )
    for _attempt in range(2):
        export.unlink(missing_ok=True)  # perf_analyzer refuses an export path that exists
        result = subprocess.run(cmd, env=perf_tools.tools_env(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Request concurrency: 2" in result.stdout
        # perf_analyzer can leave an empty export after a clean run (docs/wire-contract.md): one retry.
        if export.is_file() and export.stat().st_size > 0:
            break

    assert export.is_file() and export.stat().st_size > 0, "empty export:\n" + result.stdout + result.stderr
    max_tokens = SamplingParams.from_json(
        json.loads(PERF_INPUT.read_text())["data"][0]["sampling_params"][0]
    ).max_tokens
    (experiment,) = json.loads(export.read_text())["experiments"]
    assert len(experiment["requests"]) == requests
    for request in experiment["requests"]:
        outputs = request["response_outputs"]
        # One response per step; on a loaded machine the sender may join a sequence's pending steps into one
        # (docs/contract.md, "Joined steps"). Each step here makes one token, so every response must start at
        # the step after the tokens before it. (`num_steps` is not read: perf_analyzer exports an absent
        # output as whatever its buffer held.)
        assert len(request["response_timestamps"]) == len(outputs) <= max_tokens
        assert len(outputs) >= max_tokens // 2
        step = 0
        for o in outputs:
            assert o["step"] == step
            step += len(_token_ids(o))
        assert step == max_tokens
        assert all(
            o["finish_reason"] == "" for o in outputs[:-1]
        )  # absent (docs/wire-contract.md): perf_analyzer shows ""
        assert outputs[-1]["finish_reason"] == "length"
        assert outputs[-1]["num_output_tokens"] == max_tokens

    (row,) = perf_tools.summarize_pa_export(export)
    assert row["requests"] == requests and row["output_tokens_mean"] == max_tokens
    assert row["output_token_throughput"] > 0 and row["ttft_ms_p50"] > 0 and row["itl_ms_p50"] > 0


def _token_ids(output: dict) -> list:
    ids = output["token_ids"]
    return ids if isinstance(ids, list) else [ids]
