"""lm-evaluation-harness end to end: the pinned lm-eval (its own venv, .tools/lm-eval) runs a small
multiple-choice task and a generate_until task, both from local JSONL files written here (no hub), through
`local-completions` and the server's own tokenizer endpoints against the real tritonserver + frontend.

Checked against the in-process engine: every choice's loglikelihood within 1e-3, the same accuracy, and
the same generated texts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from backend.config import EngineConfig
from backend.engine import LLMEngine
from protocol import SamplingParams, StepOutput
from scripts import lm_eval
from tests.engine_helpers import smollm2_checkpoint

pytestmark = pytest.mark.slow

MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "ten", "four"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "yellow"], 2),
    ("Which animal says moo?", ["cat", "dog", "duck", "cow"], 3),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Water freezes at how many degrees Celsius?", ["0", "100", "50", "-40"], 0),
]
GEN = [("The capital of France is", " Paris"), ("One, two, three,", " four"), ("The opposite of hot is", " cold")]
UNTIL = ["\n", "."]
MAX_GEN = 12


def write_tasks(folder: Path) -> None:
    (folder / "mc.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC)
    )
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (folder / "local_mc.yaml").write_text(f"""task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (folder / "local_gen.yaml").write_text(f"""task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {json.dumps(UNTIL)}
  max_gen_toks: {MAX_GEN}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")


def read_samples(out: Path, task: str) -> list[dict]:
    [path] = out.rglob(f"samples_{task}_*.jsonl")
    return sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(num_kv_blocks=256, num_threads=1), checkpoint=smollm2_checkpoint())


def run_engine(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[StepOutput]:
    engine.add_request(engine.make_request("ref", ids, params))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    return outputs


def reference_loglikelihood(engine: LLMEngine, context: str, continuation: str) -> float:
    """lm-eval's own split (`_encode_pair`): the continuation's tokens are those the whole adds to the context."""
    tok = engine.tokenizer
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctxlen = len(tok.encode(context, add_special_tokens=False))
    [first] = [o for o in run_engine(engine, whole, SamplingParams(max_tokens=1, prompt_logprobs=0)) if o.step == 0]
    return sum(first.prompt_logprobs.logprobs[ctxlen - 1 :])


def test_lm_eval_matches_the_in_process_engine(servers, engine, tmp_path: Path) -> None:
    lm_eval.ensure_venv()  # first use: creates .tools/lm-eval (about a minute)
    write_tasks(tmp_path)
    out = tmp_path / "out"
    cmd = lm_eval.command(servers.frontend.url, servers.model, ["local_mc", "local_gen"], out, include_path=tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Using remote tokenizer" in result.stderr  # the server's tokenizer, found from base_url alone

    hits = 0
    for sample in read_samples(out, "local_mc"):
        question, choices, answer = MC[sample["doc_id"]]
        served = [float(ll) for ll, _ in sample["filtered_resps"]]
        expected = [reference_loglikelihood(engine, f"Question: {question}\nAnswer:", f" {c}") for c in choices]
        assert served == pytest.approx(expected, abs=1e-3), question
        assert sample["acc"] == float(max(range(len(choices)), key=expected.__getitem__) == answer)
        hits += sample["acc"] == 1.0
    [results] = out.rglob("results_*.json")
    reported = json.loads(results.read_text())["results"]
    assert reported["local_mc"]["acc,none"] == pytest.approx(hits / len(MC))

    for sample in read_samples(out, "local_gen"):
        prompt = GEN[sample["doc_id"]][0]
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        params = SamplingParams(max_tokens=MAX_GEN, temperature=0, stop=(*UNTIL, engine.tokenizer.eos_token))
        text = "".join(o.text_delta for o in run_engine(engine, ids, params))
        assert sample["filtered_resps"][0] == text, prompt
