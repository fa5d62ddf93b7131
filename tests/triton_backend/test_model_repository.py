"""The Triton model repository's config agrees with the engine and the model it serves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from backend.config import EngineConfig, instance_settings
from tests.engine_helpers import smollm2_tokenizer

CONFIG = Path(__file__).resolve().parents[2] / "model_repository" / "smollm2-135m-instruct" / "config.pbtxt"


def pbtxt_parameters() -> dict[str, str]:
    text = CONFIG.read_text()
    pattern = r'parameters \{ key: "([^"]+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \} \}'
    return {key: json.loads(value) for key, value in re.findall(pattern, text)}


def test_config_is_decoupled_python_backend():
    text = CONFIG.read_text()
    assert 'backend: "python"' in text and "decoupled: true" in text and 'name: "smollm2-135m-instruct"' in text


def test_engine_parameters_build_a_valid_engine_config():
    params = pbtxt_parameters()
    config = EngineConfig.from_strings({**params, **instance_settings(params, "CPU", cpu_instances=1, cpu_threads=2)})
    assert config.model == "smollm2" and config.device == "cpu" and config.enable_prefix_caching
    assert config.num_threads == 2 and params["model_type"] == "llm"


def test_instances_split_the_cores_or_take_a_gpu_each():
    auto = {"num_threads": "auto"}
    assert instance_settings(auto, "CPU", cpu_instances=2, cpu_threads=16) == {"num_threads": "8"}
    assert instance_settings(auto, "CPU", cpu_instances=4, cpu_threads=2) == {"num_threads": "1"}
    assert instance_settings({"num_threads": "3"}, "CPU", cpu_instances=2, cpu_threads=16) == {}
    assert instance_settings(auto, "GPU", cpu_instances=0, cpu_threads=16) == {"device": "cuda"}


def test_chat_template_and_special_tokens_match_the_gguf():
    params = pbtxt_parameters()
    tok = smollm2_tokenizer()
    assert params["chat_template"] == tok.chat_template
    assert params["eos_token"] == tok.eos_token
    assert params["bos_token"] == tok.bos_token


MODEL_PY = CONFIG.parent / "1" / "model.py"
_LOAD_MODEL_PY = """
import importlib.util, os, sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
loaded_before = "torch" in sys.modules
spec = importlib.util.spec_from_file_location("model", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(os.environ.get("GOMP_SPINCOUNT"), loaded_before, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "env, spincount", [({}, "10000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")]
)
def test_model_py_shortens_openmp_spinning_and_leaves_torch_to_initialize_unless_the_user_chose(env, spincount):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_MODEL_PY, str(MODEL_PY)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    # Set at import; torch (and libgomp, which reads it) loads only in initialize(), after the engine's CPU
    # placement (backend/cpu_placement.py), which must also come before libgomp.
    assert out == [spincount, "False", "False"]
