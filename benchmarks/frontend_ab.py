"""Two frontends on one tritonserver, A and B, and blocks of streamed requests sent to each in turn.

What it is for: a change to the frontend costs or saves a few hundredths of a millisecond of CPU a
token, far less than this machine's drift moves tok/s between runs and between server sets
(`make bench-ab`). Here both frontends talk to the same engine, so the frontend is the only difference
between them, and each block measures the frontend's own CPU per token (its threads' run time from
/proc/<pid>/task/*/schedstat), which follows the VM's phase but moves the same way for both. The pairs
go A B, B A, A B, ... so that a drift within a pair favours neither; every block has fresh prompts (a
prompt sent twice would find its prefix cached).

A runs this tree. B runs `--base REF` (a git revision, checked out into a temporary worktree), or
this tree too; `--env-a` / `--env-b KEY=VALUE` set either frontend's environment.

usage: .venv/bin/python -m benchmarks.frontend_ab --base HEAD~1 --pairs 16 --concurrency 1

Prints each pair, then both frontends' mean CPU per token and tok/s, B / A, and in how many pairs A
took less CPU. The last line printed is one JSON object. Figures: docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_ab import compare, parse_settings
from benchmarks.serve_bench import make_prompts, serve_level, summarize, warm_up_serving

SIDES = ("A", "B")


def block_order(pair: int) -> tuple[str, str]:
    """A B in even pairs and B A in odd ones, so the blocks run A B B A A B B A ..."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


def run_time_s(pid: int) -> float:
    """The CPU time of all of a process's threads so far, from their schedstat (nanoseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


@contextlib.contextmanager
def checkout(ref: str | None) -> Iterator[Path]:
    """This tree, or `ref` checked out into a temporary git worktree (removed on leaving)."""
    from scripts.servers import REPO_ROOT

    if ref is None:
        yield REPO_ROOT
        return
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=REPO_ROOT, check=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the git revision B runs (default: this tree)")
    for s in SIDES:
        parser.add_argument(f"--env-{s.lower()}", action="append", metavar="KEY=VALUE", help=f"environment of {s}")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=4, help="requests per block")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    env = {s: parse_settings(getattr(args, f"env_{s.lower()}")) for s in SIDES}

    import torch

    from backend.checkpoint import load_checkpoint
    from scripts.servers import REPO_ROOT, Frontend, TritonServer, free_port

    tokenizer = load_checkpoint("smollm2", dtype=torch.float32).tokenizer
    salt = random.SystemRandom().randrange(2**31)
    logs = REPO_ROOT / "artifacts" / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"A: this tree, env {env['A']}; B: {args.base or 'this tree'}, env {env['B']}; salt {salt}", flush=True)
    tok_s: dict[str, list[float]] = {s: [] for s in SIDES}
    cpu_ms: dict[str, list[float]] = {s: [] for s in SIDES}
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(checkout(args.base))
        triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        triton.start(log_path=logs / "tritonserver-frontend-ab.log")
        stack.callback(triton.stop)
        frontends = {}
        for s, tree in zip(SIDES, (REPO_ROOT, base), strict=True):
            frontends[s] = Frontend(triton.grpc_url, port=free_port(), extra_env=env[s], tree=tree)
            frontends[s].start(log_path=logs / f"frontend-ab-{s}.log")
            stack.callback(frontends[s].stop)
            warm_up_serving(args, tokenizer, frontends[s].url, structured=False)
        for pair in range(args.pairs):
            for k, s in enumerate(block_order(pair)):
                seed = args.seed + 2 * pair + k
                prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens, seed, salt + seed)
                before = run_time_s(frontends[s].proc.pid)
                result = summarize(args.concurrency, serve_level(args, frontends[s].url, prompts, args.concurrency))
                spent = run_time_s(frontends[s].proc.pid) - before
                if result.errors:
                    raise SystemExit(f"frontend {s}: {result.errors} requests failed")
                tok_s[s].append(round(result.output_tok_s, 2))
                cpu_ms[s].append(round(spent * 1e3 / max(result.output_tokens, 1), 4))
            print(
                f"pair {pair + 1}: " + ", ".join(f"{s} {tok_s[s][-1]:.1f} tok/s {cpu_ms[s][-1]:.3f} ms" for s in SIDES),
                flush=True,
            )
    throughput = compare(tok_s["A"], tok_s["B"])
    cpu = {s: round(statistics.fmean(cpu_ms[s]), 4) for s in SIDES}
    a_cheaper = sum(a < b for a, b in zip(cpu_ms["A"], cpu_ms["B"], strict=True))
    print(
        f"frontend CPU ms per token: A {cpu['A']}, B {cpu['B']} (B / A {cpu['B'] / cpu['A']:.3f}; A took less in "
        f"{a_cheaper} of {args.pairs} pairs); tok/s: A {throughput.a_mean}, B {throughput.b_mean} (B / A "
        f"{throughput.b_over_a}, B faster in {throughput.b_faster_rounds} pairs)",
        flush=True,
    )
    print(
        json.dumps(
            {
                "base": args.base,
                "env": env,
                "concurrency": args.concurrency,
                "pairs": args.pairs,
                "cpu_ms_per_token": cpu_ms,
                "cpu_ms_per_token_mean": cpu,
                "a_cheaper_pairs": a_cheaper,
                "tok_s": tok_s,
                "tok_s_b_over_a": throughput.b_over_a,
            }
        )
    )


if __name__ == "__main__":
    main()
