"""`make bench-wire`: how many tokens per second the response path carries, with no model in the way.

The real tritonserver and the real frontend serve a copy of the model repository whose engine is the
stand-in (backend/stand_in_engine.py): one token per running sequence every --step-ms, as a GPU
engine at a large batch would make them. For each concurrency level, that many streamed completions
(max_tokens --max-tokens, all at once, each refilled when it ends) run for the level; every stream
must come back exact (max_tokens tokens of the stand-in's text, usage and finish_reason right, no
error). Printed per level: tokens per second that reached the SSE clients, the rate the stand-in
offered (streams / step time), responses per token (below 1 once the sender joins steps under
backpressure), and the CPU milliseconds per token of the stub (engine loop + sender), tritonserver,
the frontend and this client. The last line is one JSON object. Goal: >= 20,000 tok/s at 256 streams.

    .venv/bin/python -m benchmarks.wire_bench [--concurrency 64 256 1024] [--step-ms 10] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from backend.stand_in_engine import TOKEN_TEXT as TEXT
from benchmarks import sse_client
from benchmarks.serve_profile import (
    PySpy,
    cpu_delta,
    cpu_per_process,
    print_cpu,
    read_trace,
    step_figures,
    thread_cpu,
)
from benchmarks.sse_client import STATUS_OK, SSEConnection, dechunk, post_request
from scripts.servers import DEFAULT_MODEL as MODEL
from scripts.servers import REPO_ROOT, copy_model_repository, running_servers
from scripts.stub_supervisor import stub_processes


def stand_in_repository(folder: Path, step_ms: float, max_num_seqs: int) -> Path:
    added = {"engine": "stand-in", "stand_in_step_ms": str(step_ms)}
    return copy_model_repository(folder, added, max_num_seqs=str(max_num_seqs))


def check_stream(raw: bytes, max_tokens: int) -> tuple[int, int, str | None]:
    """One streamed completion's raw HTTP response -> (tokens, SSE chunks with text, what was wrong or
    None when the stream is exact: max_tokens tokens of the stand-in's text, finish_reason length,
    usage right, no error, [DONE] last)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if not head.startswith(STATUS_OK):
        return 0, 0, head.split(b"\r\n")[0].decode(errors="replace") or "no response"
    if b"transfer-encoding: chunked" in head.lower():
        body = dechunk(body)
    events = [e[6:] for e in body.decode().split("\n\n") if e.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return 0, 0, "the stream did not end with [DONE]"
    text, chunks, usage, finish = [], 0, None, None
    for event in map(json.loads, events[:-1]):
        if "error" in event:
            return 0, chunks, event["error"]["message"]
        if event.get("choices"):
            chunks += 1
            text.append(event["choices"][0]["text"])
            finish = event["choices"][0]["finish_reason"] or finish
        elif event.get("usage"):
            usage = event["usage"]
    text = "".join(text)
    tokens = text.count(TEXT)
    if text != TEXT * max_tokens or finish != "length" or not usage or usage["completion_tokens"] != max_tokens:
        return tokens, chunks, f"{tokens} tokens, finish {finish}, usage {usage}"
    return tokens, chunks, None


async def run_level(host: str, port: int, concurrency: int, max_tokens: int, seconds: float) -> dict:
    stats = {"tokens": 0, "streams": 0, "exact": 0, "chunks": 0, "errors": []}
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    request = post_request(host, port, "/v1/completions", body)
    deadline = time.perf_counter() + seconds
    loop = asyncio.get_running_loop()

    async def worker():
        connection = None
        while time.perf_counter() < deadline:
            if connection is None or connection.closed:
                _, connection = await loop.create_connection(SSEConnection, host, port)
            await connection.send(request)
            tokens, chunks, error = check_stream(connection.response(), max_tokens)
            stats["tokens"] += tokens
            stats["streams"] += 1
            stats["exact"] += error is None
            stats["chunks"] += chunks
            if error is not None and len(stats["errors"]) < 3:
                stats["errors"].append(error)
        if connection is not None:
            connection.transport.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    stats["seconds"] = time.perf_counter() - start
    return stats


def run_and_report(c: int, args: argparse.Namespace, frontend, pids: dict[str, int], scratch: Path) -> dict:
    """One level: its streams, then what it printed (and returns): tok/s, exactness, CPU per token, and
    with --py-spy / --trace the stub's and frontend's hottest functions / the stub's step timings."""
    before, since = thread_cpu(pids), time.perf_counter()
    profiled = {k: pids[k] for k in ("stub", "frontend")}
    spy = PySpy(profiled, args.seconds / 3, args.seconds / 3, scratch) if args.py_spy else None
    stats = sse_client.run(run_level(frontend.host, frontend.port, c, args.max_tokens, args.seconds))
    delta = cpu_delta(before, thread_cpu(pids))
    tokens = max(stats["tokens"], 1)
    cpu = cpu_per_process(delta)
    level = {
        "tok_s": round(stats["tokens"] / stats["seconds"], 1),
        "offered_tok_s": round(c / (args.step_ms / 1e3), 1),
        "streams": stats["streams"],
        "exact_streams": stats["exact"],
        "chunks_per_token": round(stats["chunks"] / tokens, 3),
        "cpu_ms_per_token": {k: round(1e3 * v / tokens, 3) for k, v in cpu.items()},
        "errors": stats["errors"],
    }
    print(f"c={c}: {level['tok_s']} tok/s reached the clients (offered {level['offered_tok_s']}); "
          f"{stats['exact']}/{stats['streams']} streams exact; {level['chunks_per_token']} chunks per token; "
          f"CPU ms/token {level['cpu_ms_per_token']}", flush=True)  # fmt: skip
    if spy is not None:
        level["py_spy"] = spy.top()
        for label, frames in level["py_spy"].items():
            print(f"  py-spy {label} (share of samples running in each function itself):")
            for frame, share in frames:
                print(f"    {share:5.1f}% {frame}")
    if args.trace:
        time.sleep(1.0)  # the stub writes its trace once the engine is idle
        for path in sorted(scratch.glob("step-trace.*")):
            steps, sends = read_trace(path, since)
            level["trace"] = step_figures(steps, sends)
            span = steps[-1][1] - steps[0][0] if len(steps) > 1 else 0.0
            level["trace"]["steps_per_s"] = len(steps) / span if span else None
            print(f"  {path.name}: {level['trace']}")
        level["threads"] = print_cpu(delta, tokens)["threads"]
    return level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each level starts new streams")
    parser.add_argument("--trace", action="store_true", help="also print the stub's step and send timings per level")
    parser.add_argument(
        "--py-spy", action="store_true", help="also sample the stub's and the frontend's Python stacks mid-level"
    )
    args = parser.parse_args()

    folder = stand_in_repository(Path(tempfile.mkdtemp()), args.step_ms, max(args.concurrency))
    scratch = Path(tempfile.mkdtemp())
    trace = scratch / "step-trace"  # backend/engine_loop.StepTrace appends the instance name
    report = {"step_ms": args.step_ms, "max_tokens": args.max_tokens, "levels": {}}
    logs = REPO_ROOT / "artifacts" / "bench-logs"
    env = {"LLM_STEP_TRACE": str(trace)} if args.trace else None
    try:
        with running_servers(logs, "-wire", model_repository=folder, supervise=False, extra_env=env) as servers:
            triton, frontend = servers
            pids = {"stub": next(iter(stub_processes(triton.proc.pid))), "tritonserver": triton.proc.pid,
                    "frontend": frontend.proc.pid, "client": os.getpid()}  # fmt: skip
            sse_client.run(run_level(frontend.host, frontend.port, 4, 8, 0.5))  # warm-up
            for c in args.concurrency:
                report["levels"][c] = run_and_report(c, args, frontend, pids, scratch)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
