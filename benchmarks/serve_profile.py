"""Where the served time goes: the same load served and in process, step by step and thread by thread.

    .venv/bin/python -m benchmarks.serve_profile [--concurrency 1 8] [--requests 8] [--max-tokens 64]

Per concurrency level, the load of `make bench-serve` (fresh 128-token prompts, max_tokens, ignore_eos):
(a) served: tritonserver (with LLM_STEP_TRACE, see backend/engine_loop.StepTrace) and the frontend on
    free ports, the load streamed over HTTP; the CPU time of every thread of tritonserver, the model's
    stub, the frontend and this client is read from /proc before and after, with each thread's
    involuntary context switches (a thread preempted while it held work);
(b) in process: LLMEngine.step() in a loop in this process, timed the same way.
Printed per level: output tok/s; the engine step's p50 / p90 duration; the p50 gap between a step's end
and the next one's start while requests run; the p50 time from a step's end to the end of the last send
of its outputs; CPU milliseconds per output token per process and for the busiest threads.
The last line is one JSON object. Figures and what they showed: docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from benchmarks import sse_client
from benchmarks.serve_bench import make_prompts, run_inprocess_level, run_serving_level, summarize

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class ThreadStats:
    name: str
    tid: str
    cpu_s: float  # utime + stime
    voluntary_switches: int
    involuntary_switches: int


def process_threads(pid: int) -> list[ThreadStats]:
    """Every thread of a process as /proc shows it now (threads that end while it is read are left out)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread ended
        lines = (line.split(":") for line in status.splitlines() if "ctxt_switches" in line)
        switches = {key: int(value) for key, value in lines}
        out.append(
            ThreadStats(
                name,
                task.name,
                (int(fields[11]) + int(fields[12])) * TICK_S,
                switches["voluntary_ctxt_switches"],
                switches["nonvoluntary_ctxt_switches"],
            )
        )
    return out


def thread_cpu(pids: dict[str, int]) -> dict[tuple[str, str], list[float]]:
    """(process label, thread name/tid) -> [cpu seconds, involuntary context switches]."""
    out: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for label, pid in pids.items():
        for thread in process_threads(pid):
            entry = out[(label, f"{thread.name}/{thread.tid}")]
            entry[0] += thread.cpu_s
            entry[1] += thread.involuntary_switches
    return out


def cpu_delta(before, after) -> dict[tuple[str, str], tuple[float, float]]:
    keys = set(before) | set(after)
    zero = [0.0, 0.0]
    return {k: (after.get(k, zero)[0] - before.get(k, zero)[0], after.get(k, zero)[1] - before.get(k, zero)[1])
            for k in keys}  # fmt: skip


def read_trace(path: Path, since: float) -> tuple[list[tuple[float, float, int]], list[tuple[float, float, int]]]:
    steps, sends = [], []
    for line in path.read_text().splitlines() if path.exists() else []:
        kind, start, end, extra = (line.split("\t") + [""])[:4]
        if float(start) < since:
            continue
        if kind == "step":
            steps.append((float(start), float(end), int(extra or 0)))
        elif kind == "send":
            sends.append((float(start), float(end), int(extra or 1)))
    return steps, sends


def step_figures(steps: list[tuple[float, float, int]], sends: list[tuple[float, float, int]] | None) -> dict:
    """Step duration p50/p90, the gap to the next step p50 (ms), and the step end -> last send end p50."""
    durations = sorted(e - s for s, e, _ in steps)
    gaps = sorted(b[0] - a[1] for a, b in zip(steps, steps[1:]) if b[0] - a[1] < 0.5)  # not idle periods
    fig = {
        "steps": len(steps),
        "step_ms_p50": 1e3 * statistics.median(durations) if durations else None,
        "step_ms_p90": 1e3 * durations[int(0.9 * (len(durations) - 1))] if durations else None,
        "gap_ms_p50": 1e3 * statistics.median(gaps) if gaps else None,
    }
    if sends is not None:
        sent_at, covered = [], 0  # the time each step's outputs were all sent, in step order
        for _, end, n in sends:
            covered += n
            sent_at.append((covered, end))
        lags, done, j = [], 0, 0
        for _, end, n in steps:
            done += n
            while j < len(sent_at) and sent_at[j][0] < done:
                j += 1
            if n and j < len(sent_at):
                lags.append(sent_at[j][1] - end)
        fig["step_end_to_sent_ms_p50"] = 1e3 * statistics.median(lags) if lags else None
        fig["responses_per_output"] = len(sends) / max(1, covered)
    return fig


def cpu_per_process(delta) -> dict[str, float]:
    """cpu_delta's per-thread seconds summed per process label."""
    per_process: dict[str, float] = defaultdict(float)
    for (label, _), (cpu, _) in delta.items():
        per_process[label] += cpu
    return per_process


def print_cpu(delta, tokens: int, top: int = 8) -> dict:
    per_process = cpu_per_process(delta)
    print("  CPU ms per output token: " + ", ".join(f"{k} {1e3 * v / tokens:.1f}" for k, v in per_process.items()))
    busiest = sorted(delta.items(), key=lambda kv: -kv[1][0])[:top]
    for (label, name), (cpu, ctx) in busiest:
        print(f"    {label:>12} {name:<18} {1e3 * cpu / tokens:6.2f} ms/token  {ctx:7.0f} involuntary switches")
    return {
        "cpu_ms_per_token": {k: round(1e3 * v / tokens, 2) for k, v in per_process.items()},
        "threads": {
            f"{label}/{name}": [round(1e3 * cpu / tokens, 2), int(ctx)] for (label, name), (cpu, ctx) in busiest
        },
    }


class PySpy:
    """py-spy samples the Python stacks of some processes for `seconds`, starting `delay` seconds from
    now (say, in the middle of a load); `top()` then gives each process's functions by the share of
    samples in which they were running (their own code, not their callees)."""

    def __init__(self, pids: dict[str, int], delay: float, seconds: float, folder: Path) -> None:
        self.paths = {label: folder / f"py-spy-{label}.txt" for label in pids}
        binary = str(Path(sys.executable).parent / "py-spy")
        commands = [[binary, "record", "--format", "raw", "--nonblocking", "--rate", "200", "--duration",
                     str(int(seconds)), "--pid", str(pid), "--output", str(self.paths[label])]
                    for label, pid in pids.items()]  # fmt: skip
        self._procs: list[subprocess.Popen] = []
        self._timer = threading.Timer(delay, lambda: self._procs.extend(
            subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands))  # fmt: skip
        self._timer.start()

    def top(self, n: int = 12) -> dict[str, list[tuple[str, float]]]:
        self._timer.join()
        for proc in self._procs:
            proc.wait()
        result = {}
        for label, path in self.paths.items():
            own: Counter[str] = Counter()
            for line in path.read_text().splitlines() if path.exists() else []:
                stack, _, count = line.rpartition(" ")
                own[stack.rsplit(";", 1)[-1].replace(str(Path.cwd()) + "/", "")] += int(count)
            total = max(1, sum(own.values()))
            result[label] = [(frame, round(100 * k / total, 1)) for frame, k in own.most_common(n)]
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--skip-inprocess", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument(
        "--renice",
        type=int,
        default=0,
        help="nice value for every thread of tritonserver, the frontend and this "
        "client (not the model's stub): how much of the served loss is their work preempting the engine's threads",
    )
    args = parser.parse_args()

    import torch

    from backend.checkpoint import load_checkpoint
    from backend.config import EngineConfig
    from backend.engine import LLMEngine
    from scripts.servers import REPO_ROOT, running_servers
    from scripts.stub_supervisor import stub_processes

    checkpoint = load_checkpoint("smollm2", dtype=torch.float32)
    tok = checkpoint.tokenizer
    salt = int(time.time())
    prompts = {
        c: make_prompts(tok, args.requests, args.prompt_tokens, k, salt + k) for k, c in enumerate(args.concurrency)
    }
    report: dict = {"served": {}, "inprocess": {}}

    if not args.skip_served:
        trace = Path(tempfile.mkdtemp()) / "steps"
        env = {"LLM_STEP_TRACE": str(trace)}
        with running_servers(REPO_ROOT / "artifacts" / "bench-logs", extra_env=env, supervise=False) as servers:
            triton, frontend = servers
            stub = next(iter(stub_processes(triton.proc.pid)))
            pids = {"tritonserver": triton.proc.pid, "stub": stub, "frontend": frontend.proc.pid, "client": os.getpid()}
            base = frontend.url.rstrip("/").removesuffix("/v1")
            if args.renice:
                for label, pid in pids.items():
                    for task in Path(f"/proc/{pid}/task").glob("*") if label != "stub" else ():
                        os.setpriority(os.PRIO_PROCESS, int(task.name), args.renice)
            sse_client.run(run_serving_level(base, "smollm2-135m-instruct", make_prompts(tok, 2, 16, 99), 4, 2, False))
            for c in args.concurrency:
                time.sleep(0.5)  # the warm-up's (or last level's) trace is flushed at idle
                since, before = time.perf_counter(), thread_cpu(pids)
                records = sse_client.run(
                    run_serving_level(base, "smollm2-135m-instruct", prompts[c], args.max_tokens, c, False)
                )
                delta = cpu_delta(before, thread_cpu(pids))
                time.sleep(0.5)
                level = summarize(c, records)
                steps, sends = read_trace(trace.with_name(f"steps.{next(iter(_instances(trace)))}"), since)
                figs = step_figures(steps, sends)
                print(
                    f"served c={c}: {level.output_tok_s:.1f} tok/s, ITL p50 {level.itl_ms_p50:.1f} ms; {figs}",
                    flush=True,
                )
                report["served"][c] = {"tok_s": round(level.output_tok_s, 2), **_rounded(figs),
                                       **print_cpu(delta, level.output_tokens)}  # fmt: skip

    if not args.skip_inprocess:
        engine = LLMEngine(EngineConfig(), checkpoint=checkpoint)
        run_inprocess_level(engine, [tok.encode(p) for p in make_prompts(tok, 2, 16, 99)], 4, 2)  # warm-up
        real_step = engine.step
        steps: list[tuple[float, float, int]] = []

        def timed_step():
            start = time.perf_counter()
            outputs = real_step()
            steps.append((start, time.perf_counter(), len(outputs)))
            return outputs

        engine.step = timed_step
        for c in args.concurrency:
            steps.clear()
            before = thread_cpu({"inprocess": os.getpid()})
            records = run_inprocess_level(engine, [tok.encode(p) for p in prompts[c]], args.max_tokens, c)
            delta = cpu_delta(before, thread_cpu({"inprocess": os.getpid()}))
            level = summarize(c, records)
            figs = step_figures(steps, None)
            print(
                f"in-process c={c}: {level.output_tok_s:.1f} tok/s, ITL p50 {level.itl_ms_p50:.1f} ms; {figs}",
                flush=True,
            )
            report["inprocess"][c] = {"tok_s": round(level.output_tok_s, 2), **_rounded(figs),
                                      **print_cpu(delta, level.output_tokens)}  # fmt: skip
    print(json.dumps(report))


def _instances(trace: Path) -> list[str]:
    return sorted(p.name.removeprefix(trace.name + ".") for p in trace.parent.glob(trace.name + ".*"))


def _rounded(d: dict) -> dict:
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in d.items()}


if __name__ == "__main__":
    main()
