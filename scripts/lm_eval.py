"""`make lm-eval`: EleutherAI's lm-evaluation-harness against a running `make serve`.

    python -m scripts.lm_eval --tasks hellaswag --limit 100    # any lm-eval task (datasets from the hub)
    python -m scripts.lm_eval --tasks my_task --include-path DIR  # local task YAMLs (and JSONL data)

lm-eval (pinned below) lives in its own venv, `.tools/lm-eval/` (gitignored; created on first use, about
a minute): its pins would clash with the project's. It runs `local-completions` against the frontend's
/v1/completions: loglikelihood tasks send echo + logprobs requests (prompt logprobs), generate tasks plain
completions, and the tokenizer is the server's own (/tokenizer_info, /tokenize, /detokenize), so nothing
is fetched from a model hub. Extra arguments after `--` go to lm-eval unchanged.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from scripts.perf_install import REPO_ROOT, TOOLS, ensure_pinned_venv, log
from scripts.perf_tools import DEFAULT_MODEL

LM_EVAL_VENV = TOOLS / "lm-eval"

# `pip freeze` of a venv with lm-eval[api]==0.4.13 alone (no torch: the API models need none).
LM_EVAL_REQUIREMENTS = """\
lm-eval[api]==0.4.13
absl-py==2.5.1
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
chardet==6.0.0.post1
charset-normalizer==3.5.3
click==8.5.1
cloudpickle==3.1.3
colorama==0.4.6
DataProperty==1.1.1
datasets==5.2.0
defusedxml==0.7.1
dill==0.4.1
evaluate==0.4.6
filelock==4.3.2
frozenlist==1.8.0
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
Jinja2==3.1.6
joblib==1.6.0
lxml==6.2.0
MarkupSafe==3.0.4
mbstrdecoder==1.1.5
more-itertools==11.2.1
multidict==7.2.1
multiprocess==0.70.19
narwhals==2.29.0
nltk==3.10.4
numpy==2.4.6
packaging==26.4
pandas==3.1.1
pathvalidate==3.3.1
portalocker==4.4.2
propcache==0.5.4
pyarrow==26.0.1
pytablewriter==1.2.1
python-dateutil==2.9.0.post0
pytz==2026.6
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
rouge_score==0.1.2
sacrebleu==2.6.0
scikit-learn==1.9.1
scipy==1.17.1
six==1.17.0
sqlitedict==2.1.0
tabledata==1.3.5
tabulate==0.10.0
tcolorpy==0.1.7
tenacity==9.2.1
threadpoolctl==3.8.0
tiktoken==0.14.0
tqdm==4.70.1
truststore==0.10.5
typepy==1.3.5
typing_extensions==4.16.0
urllib3==2.8.0
word2number==1.1
xxhash==4.1.0
yarl==1.25.1
"""


def lm_eval_binary() -> Path:
    return LM_EVAL_VENV / "bin" / "lm-eval"


def ensure_venv() -> None:
    """Create `.tools/lm-eval` and install the pinned lm-eval, again only when the pins change."""
    ensure_pinned_venv(
        LM_EVAL_VENV,
        LM_EVAL_REQUIREMENTS,
        LM_EVAL_VENV / "requirements.txt",
        lm_eval_binary(),
        "lm-eval 0.4.13 into .tools/lm-eval (about 800 MB, once)",
        pip_env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
    )


def command(
    base_url: str,
    model: str,
    tasks: list[str],
    output_path: Path,
    *,
    include_path: Path | None = None,
    limit: int | None = None,
    num_concurrent: int = 1,
    extra: list[str] | None = None,
) -> list[str]:
    """The lm-eval command line; base_url is the frontend's root (http://host:port)."""
    args = [
        str(lm_eval_binary()),
        "run",
        "--model",
        "local-completions",
        "--model_args",
        f"model={model},base_url={base_url}/v1/completions,num_concurrent={num_concurrent}",
        "--tasks",
        ",".join(tasks),
        "--output_path",
        str(output_path),
        "--log_samples",
    ]
    if include_path is not None:
        args += ["--include_path", str(include_path)]
    if limit is not None:
        args += ["--limit", str(limit)]
    return args + list(extra or [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.lm_eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", type=Path, default=None, help="a folder of local task YAMLs")
    parser.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    parser.add_argument("--num-concurrent", type=int, default=4, help="requests in flight")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--url", default=f"http://127.0.0.1:{os.environ.get('FRONTEND_PORT', '9000')}", help="the OpenAI frontend"
    )
    parser.add_argument("--output-path", type=Path, default=REPO_ROOT / "artifacts" / "lm-eval")
    args, extra = parser.parse_known_args(argv)
    ensure_venv()
    cmd = command(
        args.url,
        args.model,
        args.tasks.split(","),
        args.output_path,
        include_path=args.include_path,
        limit=args.limit,
        num_concurrent=args.num_concurrent,
        extra=[a for a in extra if a != "--"],
    )
    log(" ".join(cmd))
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
