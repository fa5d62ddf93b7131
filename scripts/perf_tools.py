"""`make perf` and `make genai-perf`: Triton's own benchmarking tools against a running `make serve`.

    python -m scripts.perf_tools install      # only install the tools (done on first use anyway)
    python -m scripts.perf_tools perf         # perf_analyzer --streaming, gRPC, against the Triton model
    python -m scripts.perf_tools genai-perf   # genai-perf profile against the OpenAI frontend

The tools live in `.tools/` (gitignored), apart from the project's venv, whose pins they would clash
with (perf_analyzer comes from tritonclient 2.50.0, the last wheel whose binary runs on glibc 2.36;
the frontend uses a newer tritonclient):

- `.tools/venv/`: tritonclient==2.50.0 (its `bin/perf_analyzer`), genai-perf==0.0.16 and
  nvidia-cuda-runtime-cu12 (perf_analyzer links `libcudart.so.12`; loading it needs no GPU);
- `.tools/lib/libb64.so.0d`: perf_analyzer also links libb64. The nvidia-pytriton wheel the
  project already installs carries a copy (`nvidia_pytriton.libs/libb64-<hash>.so.0d`); without it,
  Debian's `libb64-0d` is installed with apt-get;
- `.tools/tokenizer/`: the model's tokenizer as a Hugging Face folder (genai-perf counts tokens with
  it and cannot fetch one from a hub), exported from the GGUF by `backend/checkpoint.py`.

Both commands exit with status 2 and say to run `make serve` when the server is not there. Ports:
TRITON_GRPC_PORT (8001) and FRONTEND_PORT (9000), as for `make serve`. Results go to
`artifacts/perf/` and `artifacts/genai-perf/`; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / ".tools"
TOOLS_VENV = TOOLS / "venv"
TOOLS_LIB = TOOLS / "lib"
TOKENIZER_DIR = TOOLS / "tokenizer"
PERF_INPUT = REPO_ROOT / "benchmarks" / "perf_input.json"
DEFAULT_MODEL = "smollm2-135m-instruct"

# The tools' venv, pinned as resolved here (`pip freeze` of a venv with the three top-level ones).
TOOLS_REQUIREMENTS = """\
tritonclient==2.50.0
genai-perf==0.0.16
nvidia-cuda-runtime-cu12==12.9.79
alembic==1.20.1
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
choreographer==1.4.0
click==8.5.1
colorlog==6.12.0
cramjam==2.14.0
fastparquet==2026.9.0
filelock==4.3.1
formulaic==1.2.2
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
iniconfig==2.3.1
interface_meta==2.0.1
Jinja2==3.1.6
kaleido==1.5.1
logistro==2.0.1
Mako==1.4.3
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
narwhals==2.29.0
numpy==1.26.4
optuna==3.6.1
orjson==3.13.0
packaging==26.4
pandas==3.0.6
patsy==1.0.3
perf_analyzer==0.1.0
pillow==13.0.0
platformdirs==4.14.9
plotly==7.1.0
pluggy==1.7.0
pyarrow==26.0.1
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
pytest==9.2.0
pytest-mock==3.17.0
python-dateutil==4.0.0
python-rapidjson==1.25
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
responses==0.26.3
rich==15.0.0
safetensors==0.8.0
scipy==1.17.1
shellingham==1.5.4
simplejson==4.3.0
soundfile==0.14.0
SQLAlchemy==2.1.9
statsmodels==0.15.0
tokenizers==0.23.3
tqdm==4.70.1
transformers==5.24.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
urllib3==2.8.0
wrapt==2.5.2
"""


class ToolError(RuntimeError):
    """Something the user has to act on; printed without a traceback."""


class ServerNotRunning(ToolError):
    pass


def log(message: str) -> None:
    print(f"[perf_tools] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ install


def _tools_python() -> Path:
    return TOOLS_VENV / "bin" / "python"


def perf_analyzer_binary() -> Path:
    return TOOLS_VENV / "bin" / "perf_analyzer"


def _tools_site_packages() -> Path:
    out = subprocess.run(
        [str(_tools_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def ensure_tools_venv() -> None:
    """Create `.tools/venv` and install the pinned tools, again only when the pins change."""
    ensure_pinned_venv(
        TOOLS_VENV,
        TOOLS_REQUIREMENTS,
        TOOLS / "requirements.txt",
        perf_analyzer_binary(),
        "tritonclient 2.50.0 (perf_analyzer), genai-perf 0.0.16, nvidia-cuda-runtime-cu12 "
        "into .tools/venv (about 1 GB, once)",
    )


def ensure_pinned_venv(
    venv: Path,
    requirements: str,
    requirements_file: Path,
    binary: Path,
    what: str,
    pip_env: dict[str, str] | None = None,
) -> None:
    """A venv of the base interpreter holding exactly `requirements`; (re)installed only when the pins
    change (a stamp named by their hash) or `binary` is missing."""
    digest = hashlib.sha256(requirements.encode()).hexdigest()[:16]
    stamp = venv / f".installed-{digest}"
    if stamp.exists() and binary.exists():
        return
    venv.parent.mkdir(exist_ok=True)
    python = venv / "bin" / "python"
    if not python.exists():
        # The base interpreter, not the project's venv: a tools' venv must see none of its packages.
        base = getattr(sys, "_base_executable", None) or sys.executable
        log(f"creating {venv.relative_to(REPO_ROOT)} with {base}")
        subprocess.run([base, "-m", "venv", str(venv)], check=True)
    requirements_file.write_text(requirements)
    log(f"installing {what}")
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-r", str(requirements_file)],
        check=True,
        env=pip_env,
    )
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()


def _find_pytriton_libb64() -> Path | None:
    """The copy of libb64 inside the nvidia-pytriton wheel (installed in the project's venv)."""
    folders = [
        Path(sysconfig.get_paths()["purelib"]) / "nvidia_pytriton.libs",
        *(REPO_ROOT / ".venv" / "lib").glob("python3*/site-packages/nvidia_pytriton.libs"),
    ]
    for folder in folders:
        found = sorted(folder.glob("libb64*.so.0d")) if folder.is_dir() else []
        if found:
            return found[0]
    return None


def _system_has(soname: str) -> bool:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return False
    return soname in out


def ensure_libb64() -> None:
    target = TOOLS_LIB / "libb64.so.0d"
    if target.exists():
        return
    TOOLS_LIB.mkdir(parents=True, exist_ok=True)
    found = _find_pytriton_libb64()
    if found is not None:
        shutil.copy2(found, target)  # a copy, not a link: survives a rebuilt .venv
        log(f"libb64.so.0d: copied from {found}")
        return
    if _system_has("libb64.so.0d"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ToolError("perf_analyzer needs libb64.so.0d: install Debian's libb64-0d (apt-get install libb64-0d)")
    log("libb64.so.0d: installing Debian's libb64-0d with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", "libb64-0d"]
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, check=True)
        subprocess.run(cmd, env=env, check=True)


def tools_env() -> dict[str, str]:
    """Environment for perf_analyzer and genai-perf: their venv first on PATH, their libraries, offline hub."""
    cudart = _tools_site_packages() / "nvidia" / "cuda_runtime" / "lib"
    libs = [str(TOOLS_LIB), str(cudart)]
    if os.environ.get("LD_LIBRARY_PATH"):
        libs.append(os.environ["LD_LIBRARY_PATH"])
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    env.update(
        PATH=os.pathsep.join([str(TOOLS_VENV / "bin"), env.get("PATH", "")]),
        LD_LIBRARY_PATH=os.pathsep.join(libs),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        COLUMNS=env.get("COLUMNS", "160"),  # genai-perf's rich table: wide enough to read
    )
    return env


def ensure_tokenizer() -> Path:
    """The model's tokenizer as a HF folder (tokenizer.json + tokenizer_config.json) for genai-perf."""
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TOKENIZER_DIR
    log(f"exporting the model's tokenizer to {TOKENIZER_DIR.relative_to(REPO_ROOT)}")
    sys.path.insert(0, str(REPO_ROOT))
    from backend.checkpoint import load_checkpoint  # the project's venv; reads/writes the .cache/ checkpoint

    tmp = TOKENIZER_DIR.with_name(f"tokenizer.tmp-{os.getpid()}")
    load_checkpoint("smollm2").tokenizer.save(tmp)
    shutil.rmtree(TOKENIZER_DIR, ignore_errors=True)
    tmp.rename(TOKENIZER_DIR)
    return TOKENIZER_DIR


def install(tokenizer: bool = True) -> None:
    ensure_tools_venv()
    ensure_libb64()
    result = subprocess.run(
        [str(perf_analyzer_binary()), "--version"], env=tools_env(), capture_output=True, text=True, check=False
    )
    if result.returncode != 0 or "Perf Analyzer" not in result.stdout + result.stderr:
        raise ToolError(f"perf_analyzer does not start:\n{result.stdout}{result.stderr}")
    if tokenizer:
        ensure_tokenizer()


# ------------------------------------------------------------------------------------------ servers


def triton_grpc_url() -> str:
    return f"127.0.0.1:{int(os.environ.get('TRITON_GRPC_PORT', 8001))}"


def frontend_url() -> str:
    return f"http://127.0.0.1:{int(os.environ.get('FRONTEND_PORT', 9000))}"


def check_triton(url: str, model: str) -> None:
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(url)
        ready = client.is_server_ready(client_timeout=5) and client.is_model_ready(model, client_timeout=5)
    except Exception as e:  # noqa: BLE001 - any transport error means: not there
        raise ServerNotRunning(
            f"no Triton server at {url} ({type(e).__name__}): start it with `make serve` "
            "(in another terminal) and run this again"
        ) from None
    if not ready:
        raise ServerNotRunning(f"Triton at {url} is not ready or has no model {model!r}: start it with `make serve`")


def check_frontend(url: str) -> None:
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
            if response.status == 200:
                return
    except OSError as e:
        raise ServerNotRunning(
            f"no OpenAI frontend at {url} ({e}): start it with `make serve` (in another terminal) and run this again"
        ) from None
    raise ServerNotRunning(f"the OpenAI frontend at {url} is not ready: start it with `make serve`")


# ------------------------------------------------------------------------------------------ stats


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class ExportedRequest:
    """One request of a perf_analyzer profile export: when it was sent and when each of its responses
    came (ns, perf_analyzer's clock), and its output tokens (the final response's num_output_tokens)."""

    sent_ns: int
    responses_ns: tuple[int, ...]
    tokens: int


def exported_requests(path: Path) -> list[tuple[int, list[ExportedRequest]]]:
    """(concurrency, its requests that got a response) per experiment of a perf_analyzer profile export."""
    data = json.loads(path.read_text())
    experiments = []
    for exp in data["experiments"]:
        requests = []
        for r in exp["requests"]:
            ts = r["response_timestamps"]
            if not ts:
                continue
            outs = r.get("response_outputs") or []
            n = int(outs[-1].get("num_output_tokens", len(ts))) if outs else len(ts)
            requests.append(ExportedRequest(r["timestamp"], tuple(ts), n))
        experiments.append((exp["experiment"]["value"], requests))
    return experiments


def summarize_pa_export(path: Path) -> list[dict]:
    """One row per experiment of a perf_analyzer profile export of the Triton model.

    Per request: TTFT = first response - send; ITL = (last - first response) / (tokens - 1);
    tokens = the final response's num_output_tokens (the model's own count). Throughput over the
    span from the first send to the last response."""
    rows = []
    for concurrency, requests in exported_requests(path):
        ttft = [(r.responses_ns[0] - r.sent_ns) / 1e6 for r in requests]
        latency = [(r.responses_ns[-1] - r.sent_ns) / 1e6 for r in requests]
        itl = [(r.responses_ns[-1] - r.responses_ns[0]) / 1e6 / (r.tokens - 1) for r in requests if r.tokens > 1]
        tokens = [r.tokens for r in requests]
        start = min((r.sent_ns for r in requests), default=0)
        end = max((r.responses_ns[-1] for r in requests), default=0)
        span = (end - start) / 1e9 if tokens else float("nan")
        rows.append(
            {
                "concurrency": concurrency,
                "requests": len(tokens),
                "request_throughput": len(tokens) / span,
                "output_token_throughput": sum(tokens) / span,
                "output_tokens_mean": sum(tokens) / max(len(tokens), 1),
                "ttft_ms_p50": percentile(ttft, 50),
                "ttft_ms_p95": percentile(ttft, 95),
                "itl_ms_p50": percentile(itl, 50),
                "itl_ms_p95": percentile(itl, 95),
                "latency_ms_p50": percentile(latency, 50),
                "latency_ms_p95": percentile(latency, 95),
            }
        )
    return rows


def print_table(title: str, rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format)."""
    print(f"\n{title}")
    headers = [h for _, h, _ in columns]
    cells = [
        [format(row[k], f) if isinstance(row[k], (int, float)) else str(row[k]) for k, _, f in columns] for row in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for c in cells:
        print("| " + " | ".join(v.rjust(w) for v, w in zip(c, widths)) + " |")
    sys.stdout.flush()


PERF_COLUMNS = [
    ("concurrency", "concurrency", "d"),
    ("requests", "requests", "d"),
    ("request_throughput", "req/s", ".3f"),
    ("output_token_throughput", "output tok/s", ".1f"),
    ("ttft_ms_p50", "TTFT p50 ms", ".0f"),
    ("ttft_ms_p95", "TTFT p95 ms", ".0f"),
    ("itl_ms_p50", "ITL p50 ms", ".1f"),
    ("itl_ms_p95", "ITL p95 ms", ".1f"),
    ("latency_ms_p50", "latency p50 ms", ".0f"),
    ("latency_ms_p95", "latency p95 ms", ".0f"),
]


# ------------------------------------------------------------------------------------------ perf


def perf_analyzer_command(
    model: str,
    url: str,
    concurrency: int,
    requests: int,
    input_data: Path,
    export: Path | None = None,
    csv: Path | None = None,
) -> list[str]:
    cmd = [
        str(perf_analyzer_binary()),
        "-m",
        model,
        "-u",
        url,
        "-i",
        "grpc",
        "--streaming",
        "--input-data",
        str(input_data),
        "--concurrency-range",
        str(concurrency),
        "--request-count",
        str(requests),
    ]
    if export is not None:
        cmd += ["--profile-export-file", str(export)]
    if csv is not None:
        cmd += ["-f", str(csv)]
    return cmd


def default_requests(concurrency: int) -> int:
    return max(4, 2 * concurrency)


def run_perf(args: argparse.Namespace) -> dict:
    url = args.url or triton_grpc_url()
    check_triton(url, args.model)  # before installing anything: a missing server fails fast
    install(tokenizer=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = tools_env()
    rows = []
    for c in args.concurrency:
        n = args.requests or default_requests(c)
        export, csv = out / f"pa_export_c{c}.json", out / f"pa_c{c}.csv"
        export.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite its export file
        cmd = perf_analyzer_command(args.model, url, c, n, Path(args.input_data), export, csv)
        print(f"\n$ {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            raise ToolError(f"perf_analyzer failed at concurrency {c}")
        rows.extend(summarize_pa_export(export))
    print_table(f"perf_analyzer --streaming, gRPC {url}, model {args.model}, {args.input_data}:", rows, PERF_COLUMNS)
    summary = {
        "tool": "perf_analyzer",
        "url": url,
        "model": args.model,
        "input_data": str(args.input_data),
        "results": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------------------ genai-perf


def genai_perf_command(
    model: str,
    url: str,
    endpoint_type: str,
    concurrency: int,
    requests: int,
    input_tokens: int,
    output_tokens: int,
    tokenizer: Path,
    artifact_dir: Path,
    seed: int = 0,
) -> list[str]:
    return [
        str(TOOLS_VENV / "bin" / "genai-perf"),
        "profile",
        "-m",
        model,
        "--endpoint-type",
        endpoint_type,
        "--streaming",
        "--url",
        url.removeprefix("http://"),
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--synthetic-input-tokens-mean",
        str(input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(output_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--tokenizer",
        str(tokenizer),
        "--random-seed",
        str(seed),
        "--artifact-dir",
        str(artifact_dir),
    ]


def genai_perf_export_files(artifact_dir: Path) -> tuple[Path, Path]:
    """(genai-perf's metrics JSON, perf_analyzer's raw export); genai-perf writes both into a
    subfolder it names after the model, endpoint and load."""
    found = sorted(artifact_dir.glob("**/profile_export_genai_perf.json"))
    if not found:
        raise ToolError(f"genai-perf wrote no profile_export_genai_perf.json under {artifact_dir}")
    return found[0], found[0].with_name("profile_export.json")


def read_genai_perf_export(artifact_dir: Path) -> dict:
    data = json.loads(genai_perf_export_files(artifact_dir)[0].read_text())

    def get(metric: str, stat: str = "avg") -> float:
        return float(data.get(metric, {}).get(stat, float("nan")))

    return {
        "requests": int(get("request_count")),
        "request_throughput": get("request_throughput"),
        "output_token_throughput": get("output_token_throughput"),
        "output_tokens_mean": get("output_sequence_length"),
        "input_tokens_mean": get("input_sequence_length"),
        "ttft_ms_p50": get("time_to_first_token", "p50"),
        "ttft_ms_p95": get("time_to_first_token", "p95"),
        "itl_ms_p50": get("inter_token_latency", "p50"),
        "itl_ms_p95": get("inter_token_latency", "p95"),
        "latency_ms_p50": get("request_latency", "p50"),
        "latency_ms_p95": get("request_latency", "p95"),
    }


GENAI_COLUMNS = [
    ("endpoint", "endpoint", "s"),
    ("concurrency", "concurrency", "d"),
    ("requests", "requests", "d"),
    ("input_tokens_mean", "ISL", ".0f"),
    ("output_tokens_mean", "OSL", ".1f"),
    ("request_throughput", "req/s", ".3f"),
    ("output_token_throughput", "output tok/s", ".1f"),
    ("ttft_ms_p50", "TTFT p50 ms", ".0f"),
    ("ttft_ms_p95", "TTFT p95 ms", ".0f"),
    ("itl_ms_p50", "ITL p50 ms", ".1f"),
    ("itl_ms_p95", "ITL p95 ms", ".1f"),
    ("latency_ms_p50", "latency p50 ms", ".0f"),
]


def run_genai_perf(args: argparse.Namespace) -> dict:
    url = args.url or frontend_url()
    check_frontend(url)
    install(tokenizer=True)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = tools_env()
    # genai-perf draws its synthetic prompts with --random-seed: the same seed gives the same prompts,
    # which a server that stays up already holds in its prefix cache (TTFT without prefill). So every
    # run gets its own seed, from a base that is random unless given.
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    log(f"base seed {seed} (--seed {seed} repeats these prompts)")
    rows = []
    for endpoint in args.endpoint_type:
        for c in args.concurrency:
            n = args.requests or default_requests(c)
            artifact_dir = out / f"{endpoint}-c{c}"
            shutil.rmtree(artifact_dir, ignore_errors=True)
            run_seed = seed + len(rows)
            cmd = genai_perf_command(
                args.model,
                url,
                endpoint,
                c,
                n,
                args.input_tokens,
                args.output_tokens,
                TOKENIZER_DIR,
                artifact_dir,
                run_seed,
            )
            print(f"\n$ {' '.join(cmd)}", flush=True)
            # cwd: genai-perf may leave files where it runs; keep them under artifacts/.
            if subprocess.run(cmd, env=env, cwd=out, check=False).returncode != 0:
                raise ToolError(f"genai-perf failed ({endpoint}, concurrency {c})")
            rows.append(
                {"endpoint": endpoint, "concurrency": c, "seed": run_seed, **read_genai_perf_export(artifact_dir)}
            )
    print_table(
        f"genai-perf profile, {url}, model {args.model}, ISL {args.input_tokens}, "
        f"max_tokens {args.output_tokens} with ignore_eos (OSL: genai-perf's own count, see "
        "docs/benchmarking.md):",
        rows,
        GENAI_COLUMNS,
    )
    summary = {
        "tool": "genai-perf",
        "url": url,
        "model": args.model,
        "input_tokens": args.input_tokens,
        "max_tokens": args.output_tokens,
        "results": rows,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.perf_tools", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("install", help="install perf_analyzer, genai-perf and the tokenizer into .tools/")

    perf = sub.add_parser("perf", help="perf_analyzer --streaming against the Triton model (gRPC)")
    perf.add_argument("--url", help="Triton gRPC host:port (default 127.0.0.1:$TRITON_GRPC_PORT, 8001)")
    perf.add_argument("--model", default=DEFAULT_MODEL)
    perf.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    perf.add_argument("--requests", type=int, help="requests per concurrency level (default max(4, 2 x concurrency))")
    perf.add_argument("--input-data", default=str(PERF_INPUT.relative_to(REPO_ROOT)))
    perf.add_argument("--out", default=str(REPO_ROOT / "artifacts" / "perf"))

    gp = sub.add_parser("genai-perf", help="genai-perf profile against the OpenAI frontend")
    gp.add_argument("--url", help="frontend base URL (default http://127.0.0.1:$FRONTEND_PORT, 9000)")
    gp.add_argument("--model", default=DEFAULT_MODEL)
    gp.add_argument("--endpoint-type", nargs="+", default=["completions", "chat"], choices=["completions", "chat"])
    gp.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    gp.add_argument("--requests", type=int, help="requests per run (default max(4, 2 x concurrency))")
    gp.add_argument("--input-tokens", type=int, default=128)
    gp.add_argument("--output-tokens", type=int, default=64)
    gp.add_argument("--seed", type=int, help="base --random-seed (run k uses seed + k); default: random")
    gp.add_argument("--out", default=str(REPO_ROOT / "artifacts" / "genai-perf"))

    args = parser.parse_args(argv)
    os.chdir(REPO_ROOT)
    started = time.monotonic()
    try:
        if args.command == "install":
            install(tokenizer=True)
            print(json.dumps({"perf_analyzer": str(perf_analyzer_binary()), "tokenizer": str(TOKENIZER_DIR)}))
            return 0
        summary = run_perf(args) if args.command == "perf" else run_genai_perf(args)
    except ServerNotRunning as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ToolError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    summary["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
