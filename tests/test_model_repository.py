"""The Triton model repository's config agrees with the engine and the model it serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

from backend.config import EngineConfig
from tests.engine_helpers import smollm2_tokenizer

CONFIG = Path(__file__).resolve().parents[1] / "model_repository" / "smollm2-135m-instruct" / "config.pbtxt"


def pbtxt_parameters() -> dict[str, str]:
    text = CONFIG.read_text()
    pattern = r'parameters \{ key: "([^"]+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \} \}'
    return {key: json.loads(value) for key, value in re.findall(pattern, text)}


def test_config_is_decoupled_python_backend():
    text = CONFIG.read_text()
    assert 'backend: "python"' in text and "decoupled: true" in text and 'name: "smollm2-135m-instruct"' in text


def test_engine_parameters_build_a_valid_engine_config():
    params = pbtxt_parameters()
    config = EngineConfig.from_strings(params)
    assert config.model == "smollm2" and config.device == "cpu" and config.enable_prefix_caching
    assert params["model_type"] == "llm"


def test_chat_template_and_special_tokens_match_the_gguf():
    params = pbtxt_parameters()
    tok = smollm2_tokenizer()
    assert params["chat_template"] == tok.chat_template
    assert params["eos_token"] == tok.eos_token
    assert params["bos_token"] == tok.bos_token
