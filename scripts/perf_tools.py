"""`make perf` and `make genai-perf`: Triton's own benchmarking tools against a running `make serve`.

    python -m scripts.perf_tools install      # only install the tools (done on first use anyway)
    python -m scripts.perf_tools perf         # perf_analyzer --streaming, gRPC, against the Triton model
    python -m scripts.perf_tools genai-perf   # genai-perf profile against the OpenAI frontend

The tools are installed on first use into `.tools/` (scripts/perf_install.py).

Both commands exit with status 2 and say to run `make serve` when the server is not there. Ports:
TRITON_GRPC_PORT (8001) and FRONTEND_PORT (9000), as for `make serve`. Results go to
`artifacts/perf/` and `artifacts/genai-perf/`; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from scripts.perf_install import (
    PERF_INPUT,
    REPO_ROOT,
    TOKENIZER_DIR,
    TOOLS_VENV,
    ServerNotRunning,
    ToolError,
    install,
    log,
    perf_analyzer_binary,
    tools_env,
)
from scripts.perf_results import (  # noqa: F401 - re-exported for the benchmarks and tests
    ExportedRequest,
    exported_requests,
    percentile,
    print_table,
    summarize_pa_export,
)

DEFAULT_MODEL = "smollm2-135m-instruct"

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
        "docs/performance.md):",
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
