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
from protocol import wire
from tests.engine_helpers import smollm2_tokenizer

CONFIG = Path(__file__).resolve().parents[2] / "model_repository" / "smollm2-135m-instruct" / "config.pbtxt"


def pbtxt_parameters() -> dict[str, str]:
    text = CONFIG.read_text()
    pattern = r'parameters \{ key: "([^"]+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \} \}'
    return {key: json.loads(value) for key, value in re.findall(pattern, text)}


def test_config_is_decoupled_on_the_projects_backend():
    text = CONFIG.read_text()
    assert 'backend: "llm"' in text and "decoupled: true" in text and 'name: "smollm2-135m-instruct"' in text


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


def test_the_config_declares_every_output_a_step_message_can_carry():
    declared = set(re.findall(r'\{ name: "([^"]+)" data_type', CONFIG.read_text().split("output [")[1]))
    sent = {
        *wire.STEP_OUTPUTS,
        *wire.FINISH_OUTPUTS,
        wire.NUM_STEPS_OUTPUT,
        wire.NUM_CACHED_TOKENS_OUTPUT,
        wire.EMBEDDING_OUTPUT,
        *wire.LOGPROB_OUTPUTS,
        *wire.PROMPT_LOGPROB_OUTPUTS,
    }
    assert sent <= declared


def test_chat_template_and_special_tokens_match_the_gguf():
    params = pbtxt_parameters()
    tok = smollm2_tokenizer()
    assert params["chat_template"] == tok.chat_template
    assert params["eos_token"] == tok.eos_token
    assert params["bos_token"] == tok.bos_token


BACKEND = CONFIG.parents[2] / "triton_backend"
_LOAD = """
import importlib.util, os, sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
spec = importlib.util.spec_from_file_location("model", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
from triton_backend.adapter import quiet_openmp_spinning
quiet_openmp_spinning()
print(os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def test_a_model_is_a_config_and_an_empty_version_folder():
    folder = CONFIG.parent
    assert sorted(p.name for p in folder.iterdir()) == ["1", "config.pbtxt"]
    assert [p.name for p in (folder / "1").iterdir()] == [".gitkeep"]


@pytest.mark.parametrize(
    "env, spincount", [({}, "10000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "None")]
)
def test_the_backend_changes_nothing_at_import_and_shortens_openmp_spinning_before_torch(env, spincount):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, str(BACKEND / "model.py")],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=CONFIG.parents[2],
    ).stdout.split()
    # Importing model.py sets no environment; the adapter sets the spin count (unless the user chose) before torch,
    # and libgomp reads it when torch loads, after the engine's CPU placement (backend/cpu_placement.py).
    assert out == [env.get("GOMP_SPINCOUNT", "None"), "False", spincount, "False"]


def test_the_backend_puts_its_checkout_first_on_the_stubs_path():
    code = (
        "import importlib.util, sys\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
        "spec = importlib.util.spec_from_file_location('model', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "module.add_project_to_sys_path()\n"
        "print(sys.path[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(BACKEND / "model.py")], capture_output=True, text=True, check=True, cwd="/"
    )
    assert out.stdout.strip() == str(CONFIG.parents[2])


def test_the_launcher_links_the_backend_into_tritons_backend_directory(tmp_path):
    from scripts.servers import TritonInstall

    install = TritonInstall(tmp_path / "tritonserver", tmp_path, "")
    (tmp_path / "llm").symlink_to(tmp_path)  # a stale link (another checkout) is replaced
    install.link_backend()
    install.link_backend()
    assert (tmp_path / "llm" / "model.py").resolve() == BACKEND.resolve() / "model.py"
