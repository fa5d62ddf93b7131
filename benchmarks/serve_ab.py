"""Two server sets side by side, A and B, and the bench-serve load sent to each in turn.

What it is for: an effect of a few percent on the served path is smaller than this machine's drift
between runs, so a change is measured against the code as it is on the same load, level by level, the
two sets a few seconds apart. A and B differ in

- the tritonserver environment (`--env-b KEY=VALUE`), which the model's stub inherits: engine knobs
  read from the environment, such as GOMP_SPINCOUNT or LLM_CPU_KERNELS;
- config.pbtxt parameters (`--param-b KEY=VALUE`, e.g. `stream_interval=4`): B runs a copy of the model
  repository with them replaced (scripts/servers.copy_model_repository);

or in nothing at all (the spread of identical sets). Each round sends every level to A and to B on the
same fresh prompts (made as bench-serve makes them), the order alternating from round to round, so that
the machine speeding up or slowing down within a round does not favour one set. Both sets stay up for
the whole run, so an idle set's CPU is part of what both share.

usage: .venv/bin/python -m benchmarks.serve_ab --param-b stream_interval=4 --concurrency 1 8 --rounds 4

Prints each round's output tok/s, then per level both sets' rounds, their means, B / A of the means and
in how many rounds B was faster. The last line printed is one JSON object.

Run it once with no change first: two identical sets are two processes, and processes started a minute
apart run the same step at different speeds. On 2 cores two identical sets differed by up to 8% at one
stream over four rounds (docs/performance.md), so a smaller B / A there is no evidence.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_bench import default_requests, make_prompts, serve_level, summarize, warm_up_serving

SETS = ("A", "B")


def parse_settings(items: list[str] | None) -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}."""
    settings = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        settings[key] = value
    return settings


def round_order(r: int) -> tuple[str, str]:
    """A then B in even rounds, B then A in odd ones."""
    return SETS if r % 2 == 0 else SETS[::-1]


@dataclass(frozen=True)
class Comparison:
    a_tok_s: list[float]
    b_tok_s: list[float]
    a_mean: float
    b_mean: float
    b_over_a: float  # of the means
    b_faster_rounds: int


def compare(a_tok_s: list[float], b_tok_s: list[float]) -> Comparison:
    """Two sets' output tok/s, round by round (the same rounds, in order)."""
    if len(a_tok_s) != len(b_tok_s) or not a_tok_s:
        raise ValueError("both sets need the same, non-zero number of rounds")
    a_mean, b_mean = statistics.fmean(a_tok_s), statistics.fmean(b_tok_s)
    return Comparison(
        a_tok_s=list(a_tok_s),
        b_tok_s=list(b_tok_s),
        a_mean=round(a_mean, 2),
        b_mean=round(b_mean, 2),
        b_over_a=round(b_mean / a_mean, 4) if a_mean > 0 else float("nan"),
        b_faster_rounds=sum(b > a for a, b in zip(a_tok_s, b_tok_s, strict=True)),
    )


@contextlib.contextmanager
def server_set(name: str, env: dict[str, str], params: dict[str, str], folder: Path):
    """tritonserver and the frontend for one set; `params` replace config.pbtxt parameters in a copy."""
    from scripts.servers import REPO_ROOT, copy_model_repository, running_servers

    triton_args = {"extra_env": env}
    if params:
        triton_args["model_repository"] = copy_model_repository(folder / f"repository-{name}", **params)
    logs = REPO_ROOT / "artifacts" / "bench-logs"
    with running_servers(logs, f"-ab-{name}", **triton_args) as (_, frontend):
        yield frontend.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for s in SETS:
        parser.add_argument(f"--env-{s.lower()}", action="append", metavar="KEY=VALUE", help=f"tritonserver env of {s}")
        parser.add_argument(
            f"--param-{s.lower()}", action="append", metavar="KEY=VALUE", help=f"config.pbtxt parameter of {s}"
        )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, help="requests per level and round (default as bench-serve)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    env = {s: parse_settings(getattr(args, f"env_{s.lower()}")) for s in SETS}
    params = {s: parse_settings(getattr(args, f"param_{s.lower()}")) for s in SETS}

    import torch

    from backend.checkpoint import load_checkpoint

    tokenizer = load_checkpoint("smollm2", dtype=torch.float32).tokenizer
    salt = random.SystemRandom().randrange(2**31)  # (a fresh run finds nothing in the prefix caches)
    print(f"A: env {env['A']} params {params['A']}; B: env {env['B']} params {params['B']}; salt {salt}", flush=True)
    tok_s: dict[str, dict[int, list[float]]] = {s: {c: [] for c in args.concurrency} for s in SETS}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        urls = {s: stack.enter_context(server_set(s, env[s], params[s], Path(tmp))) for s in SETS}
        for s in SETS:
            warm_up_serving(args, tokenizer, urls[s], structured=False)
        for r in range(args.rounds):
            for k, c in enumerate(args.concurrency):
                seed = args.seed + k + 1000 * r
                prompts = make_prompts(
                    tokenizer, args.requests or default_requests(c), args.prompt_tokens, seed, salt + seed
                )
                for s in round_order(r):
                    result = summarize(c, serve_level(args, urls[s], prompts, c))
                    if result.errors:
                        raise SystemExit(f"set {s}, c={c}: {result.errors} requests failed")
                    tok_s[s][c].append(round(result.output_tok_s, 2))
                    print(f"round {r + 1} c={c}: {s} {result.output_tok_s:.1f} tok/s", flush=True)
    summary = {}
    for c in args.concurrency:
        comparison = compare(tok_s["A"][c], tok_s["B"][c])
        summary[c] = asdict(comparison)
        print(
            f"c={c}: A {comparison.a_tok_s} mean {comparison.a_mean}; B {comparison.b_tok_s} mean "
            f"{comparison.b_mean}; B / A {comparison.b_over_a}, B faster in {comparison.b_faster_rounds} of "
            f"{args.rounds} rounds",
            flush=True,
        )
    print(json.dumps({"env": env, "params": params, "rounds": args.rounds, "levels": summary}))


if __name__ == "__main__":
    main()
