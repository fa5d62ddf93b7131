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
from benchmarks.serve_profile import cpu_delta, cpu_per_process, thread_cpu
from scripts.servers import DEFAULT_MODEL as MODEL
from scripts.servers import REPO_ROOT, Frontend, TritonServer, copy_model_repository, free_port, stub_processes


def stand_in_repository(folder: Path, step_ms: float, max_num_seqs: int) -> Path:
    added = {"engine": "stand-in", "stand_in_step_ms": str(step_ms)}
    return copy_model_repository(folder, added, max_num_seqs=str(max_num_seqs))


async def one_stream(client, url: str, max_tokens: int, stats: dict) -> None:
    body = {"model": MODEL, "prompt": "a b c", "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    text, chunks, usage, finish, error = [], 0, None, None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            error = f"HTTP {r.status_code}"
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("choices"):
                chunks += 1
                text.append(event["choices"][0]["text"])
                stats["tokens"] += event["choices"][0]["text"].count(TEXT)
                finish = event["choices"][0]["finish_reason"] or finish
            elif event.get("usage"):
                usage = event["usage"]
    exact = (error is None and "".join(text) == TEXT * max_tokens and finish == "length"
             and usage is not None and usage["completion_tokens"] == max_tokens)  # fmt: skip
    stats["streams"] += 1
    stats["exact"] += exact
    stats["chunks"] += chunks
    if not exact and len(stats["errors"]) < 3:
        stats["errors"].append(error or f"{len(''.join(text)) // len(TEXT)} tokens, finish {finish}, usage {usage}")


async def run_level(base_url: str, concurrency: int, max_tokens: int, seconds: float) -> dict:
    import httpx

    stats = {"tokens": 0, "streams": 0, "exact": 0, "chunks": 0, "errors": []}
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)

    async def worker(client):
        while time.perf_counter() < deadline:
            await one_stream(client, f"{base_url}/v1/completions", max_tokens, stats)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        stats["seconds"] = time.perf_counter() - start
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each level starts new streams")
    args = parser.parse_args()

    folder = stand_in_repository(Path(tempfile.mkdtemp()), args.step_ms, max(args.concurrency))
    logs = REPO_ROOT / "artifacts" / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          model_repository=folder, supervise=False)  # fmt: skip
    triton.start(log_path=logs / "wire-tritonserver.log")
    frontend = None
    report = {"step_ms": args.step_ms, "max_tokens": args.max_tokens, "levels": {}}
    try:
        frontend = Frontend(triton.grpc_url, port=free_port()).start(log_path=logs / "wire-frontend.log")
        pids = {"stub": next(iter(stub_processes(triton.proc.pid))), "tritonserver": triton.proc.pid,
                "frontend": frontend.proc.pid, "client": os.getpid()}  # fmt: skip
        base = frontend.url.rstrip("/").removesuffix("/v1")
        asyncio.run(run_level(base, 4, 8, 0.5))  # warm-up
        for c in args.concurrency:
            before = thread_cpu(pids)
            stats = asyncio.run(run_level(base, c, args.max_tokens, args.seconds))
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
            report["levels"][c] = level
            print(f"c={c}: {level['tok_s']} tok/s reached the clients (offered {level['offered_tok_s']}); "
                  f"{stats['exact']}/{stats['streams']} streams exact; {level['chunks_per_token']} chunks per token; "
                  f"CPU ms/token {level['cpu_ms_per_token']}", flush=True)  # fmt: skip
    finally:
        if frontend is not None:
            frontend.stop()
        triton.stop()
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
