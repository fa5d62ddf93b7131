"""EngineConfig(compile=True): decode-only steps run a torch.compile'd forward (backend/compiled_decode.py).

It must produce what eager mode produces, and the two graphs compiled at start must serve every
decode step (any batch size, context length, block-table width) without compiling again.

The check runs in a child process: torch.compile changes process-wide state (dynamo settings, and
inductor's import of triton breaks the Triton interpreter that tests/kernels/test_triton_kernels.py uses).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from protocol import SamplingParams, StepOutput
from tests.engine_helpers import run_to_completion, tiny_engine

pytestmark = pytest.mark.slow  # inductor compiles C++ at engine start: ~20-60 s on 2 cores


def _requests(engine):
    """Requests whose decode steps cover batch sizes 1..5 and contexts from 3 to ~60 tokens."""
    prompts = [[5, 6, 7], list(range(10, 40)), [99] * 9, list(range(200, 217)), [42, 43]]
    lengths = [40, 25, 12, 30, 6]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)
        engine.add_request(engine.make_request(f"r{i}", prompt, params))


def _wide_batch(engine):
    """Then 40 short requests at once: decode steps of 40 sequences must not compile another graph either
    (the batch >= 2 graph serves every batch size)."""
    for i in range(40):
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
        engine.add_request(engine.make_request(f"wide{i}", [300 + i, 7], params))


def _tokens_and_logprobs(outputs):
    result: dict[str, tuple[list[int], list[float]]] = {}
    for out in outputs:
        if isinstance(out, StepOutput):
            ids, lps = result.setdefault(out.request_id, ([], []))
            ids.extend(out.token_ids)
            lps.extend(out.logprobs.logprobs)
    return result


def check_compiled_matches_eager_and_never_recompiles() -> None:
    import torch._dynamo  # in the child process only (see the module docstring)

    settings = dict(max_num_seqs=48, num_kv_blocks=160, max_num_batched_tokens=128)
    eager = tiny_engine(**settings)
    _requests(eager)
    expected = _tokens_and_logprobs(run_to_completion(eager))
    _wide_batch(eager)
    expected |= _tokens_and_logprobs(run_to_completion(eager))

    compiled = tiny_engine(compile=True, **settings)  # compiles the batch-1 and batch>=2 graphs here
    assert compiled.runner.decode_forward is not None
    calls = []
    real = compiled.runner.decode_forward
    compiled.runner.decode_forward = lambda *args: calls.append(args[0].shape[0]) or real(*args)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _requests(compiled)
        got = _tokens_and_logprobs(run_to_completion(compiled))
        _wide_batch(compiled)
        got |= _tokens_and_logprobs(run_to_completion(compiled))

    assert set(calls) >= {1, 2, 3, 4, 5, 40}, calls  # decode steps of every batch size went through the graph
    assert got.keys() == expected.keys()
    for request_id, (ids, lps) in expected.items():
        assert got[request_id][0] == ids, request_id
        # Eager runs the C++ layer ops (kernels/cpu_layer_ops.cpp), the graph inductor's fusion of the torch
        # formulas: the same math rounded differently, which this random tiny model amplifies to ~1e-4.
        assert got[request_id][1] == pytest.approx(lps, abs=5e-4), request_id
    assert compiled.block_manager.stats().used == 0


def test_compiled_decode_matches_eager_and_never_recompiles():
    root = Path(__file__).resolve().parents[2]
    code = "from tests.backend.test_compiled_decode import check_compiled_matches_eager_and_never_recompiles as c; c()"
    child = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-4000:]


def test_compile_is_refused_for_cuda():
    from backend.config import EngineConfig

    with pytest.raises(ValueError, match="compile"):
        EngineConfig(device="cuda", compile=True)
