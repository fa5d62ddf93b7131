"""protocol/ and tokenization/ stand on their own: importing them loads neither torch nor any module of
the engine (backend/) or the frontend (openai_frontend/), so both sides can import them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "backend", "openai_frontend", "kernels")


@pytest.mark.parametrize(
    "module",
    ["protocol", "protocol.wire", "tokenization.tokenizer", "tokenization.model_files", "tokenization.stop_strings"],
)
def test_imports_no_engine_frontend_or_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "", f"{module} loads {found.stdout.strip()}"


def test_the_package_names_every_boundary_type() -> None:
    import protocol
    from protocol import messages, sampling

    for name in ("SamplingParams", "StructuredOutputs"):
        assert getattr(protocol, name) is getattr(sampling, name)
    for name in ("GenerateRequest", "StepOutput", "RequestFailure", "TokenLogprobs", "PromptLogprobs", "FinishReason"):
        assert getattr(protocol, name) is getattr(messages, name)
