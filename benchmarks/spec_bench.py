"""`make bench-spec`: speculative decoding (n-gram prompt lookup) served, against the same servers without it.

Two server sets side by side, as `make bench-ab` runs them (benchmarks/serve_ab.py): A with speculation
off, B with `speculative: ngram` and any config.pbtxt parameters given as --param-b (e.g.
`--param-b num_speculative_tokens=6`). Both stay up for the whole run; each round sends every workload
and level to A and to B on the same fresh prompts, the order alternating from round to round.

Two workloads:

- **greedy**, what prompt lookup is for: streamed /v1/chat/completions with the chat template,
  temperature 0, `max_tokens` 128, a mix of (a) repeating or lightly editing a passage of 130-190 words,
  (b) renaming a variable in a Python function whose identifiers repeat, (c) JSON records whose keys
  repeat. Every request asks for logprobs and token ids, and each answer of B is compared with A's
  answer to the same prompt, token by token (ids, logprobs, text, finish reason): they must be equal,
  and the run fails if any is not.
- **random**, the decode-heavy load of `make bench-serve` (benchmarks/serve_bench.py): fresh
  128-token prompts of random words, `max_tokens` 64 with `ignore_eos`, default sampling, streamed
  /v1/completions. Nothing there repeats, so speculation can only cost.

The prompts of both are seeded by a salt drawn per run and by round, level and request, so no prefix
cache holds them (only the chat template's system prompt and an instruction's first words are shared).

Per workload and level it prints output tok/s of A and B per round, their means, B / A, and from B's
Triton counters over its phases (`llm_spec_draft_tokens_total`, `llm_spec_accepted_tokens_total`) the
acceptance rate (accepted / drafted) and the share of output tokens that were accepted drafts. The
counters do not count verifications; tokens per streamed chunk (a chunk is a step's tokens unless the
frontend joined steps, which A's figure shows) stands in for tokens per step; each phase also prints the
share of the CPUs that processes outside the benchmark and its servers took meanwhile. The last line printed is
one JSON object; the exit status is 1 if any greedy answer differed.

usage: .venv/bin/python -m benchmarks.spec_bench [--rounds 3] [--param-b num_speculative_tokens=6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sse_client
from benchmarks.responses_bench import machine_busy_s, tree_cpu_s
from benchmarks.serve_ab import SETS, compare, parse_settings, round_order
from benchmarks.serve_bench import (
    RequestRecord,
    default_requests,
    make_prompts,
    serve_level,
    summarize,
    warm_up_serving,
)
from benchmarks.soak import metric
from benchmarks.sse_client import SSEConnection, post_request, timed_events

WORKLOADS = ("greedy", "random")
SPECULATION = {"speculative": "ngram"}  # B's parameters before --param-b
GOALS = {("greedy", 1): 1.8, ("greedy", 8): 1.3, ("random", 1): 0.97, ("random", 8): 0.97}  # B / A, issue 47

# ------------------------------------------------------------------------------------ greedy prompts

SUBJECTS = """The old miller|A young teacher|The harbour master|Our neighbour|The village doctor|A tired traveller
|The night watchman|My grandmother|The station clerk|A quiet student|The baker's son|An old fisherman""".split("|")
VERBS = "carried|painted|repaired|found|sold|watched|opened|counted|wrapped|cleaned|mended|hid".split("|")
OBJECTS = """a copper kettle|the broken ladder|three silver spoons|an empty bottle|the winter blanket|a box of
candles|the garden gate|a map of the valley|the kitchen window|a bundle of letters|a wooden chair|the blue
boat""".replace("\n", " ").split("|")
PLACES = """near the stone bridge|behind the market|at the edge of the forest|beside the river|on the hill above
the village|in the cold cellar|outside the station|under the oak tree""".replace("\n", " ").split("|")
TIMES = """before dawn|every Sunday|late in the evening|during the storm|after the harvest|on a bright
morning|in early spring|while the bells rang""".replace("\n", " ").split("|")
SWAPS = {"river": "stream", "village": "town", "market": "square", "forest": "wood", "bridge": "wall"}

IDENTIFIERS = """values limit result total item count mean scores threshold items acc entry size average
records cutoff output running element length ratio""".split()
FUNCTIONS = "summarize clip_values split_scores filter_items process_records".split()
FUNCTION = """def {fn}({data}, {limit}):
    {result} = []
    {total} = 0
    for {item} in {data}:
        if {item} > {limit}:
            {result}.append({item} - {limit})
            {total} += {item} - {limit}
        else:
            {result}.append({item})
            {total} += {item}
    {count} = len({result})
    if {count} == 0:
        return {result}, {total}, 0
    {mean} = {total} / {count}
    return {result}, {total}, {mean}
"""
FUNCTION_NAMES = ("data", "limit", "result", "total", "item", "count", "mean")

PEOPLE = "Alice Bruno Chen Dana Emil Fatima Georg Hana Ivan Julia Kofi Lena Marco Nora Omar Priya".split()
CITIES = "Paris Lima Tokyo Oslo Cairo Quito Lyon Porto Seoul Dakar Perth Riga".split()


def passage(rng: random.Random) -> str:
    """10-13 plain sentences, 130-190 words."""
    sentences = []
    for _ in range(rng.randint(10, 13)):
        s = f"{rng.choice(SUBJECTS).strip()} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
        if rng.random() < 0.4:
            s += f" and {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        sentences.append(f"{s} {rng.choice(TIMES)}.")
    return " ".join(sentences)


def edit_prompt(rng: random.Random) -> str:
    text = passage(rng)
    present = [w for w in SWAPS if w in text]
    if present and rng.random() < 0.5:
        w = rng.choice(present)
        return (
            f'Rewrite the following passage, changing only the word "{w}" to "{SWAPS[w]}" everywhere. '
            f"Keep everything else exactly the same.\n\n{text}"
        )
    return f"Repeat the following passage exactly, word for word.\n\n{text}"


def code_prompt(rng: random.Random) -> str:
    names = dict(zip(FUNCTION_NAMES, rng.sample(IDENTIFIERS, len(FUNCTION_NAMES)), strict=True))
    code = FUNCTION.format(fn=rng.choice(FUNCTIONS), **names)
    old = names[rng.choice(("data", "result", "total", "item"))]
    new = rng.choice([w for w in IDENTIFIERS if w not in names.values()])
    return (
        f"Rename the variable `{old}` to `{new}` in this Python function. Reply with the complete function "
        f"in a code block.\n\n```python\n{code}```"
    )


def json_prompt(rng: random.Random) -> str:
    people = [f"{name} ({rng.randint(19, 80)}) from {rng.choice(CITIES)}" for name in rng.sample(PEOPLE, 6)]
    return (
        'List these people as a JSON array of records, each an object with the fields "name", "age", "city" '
        f'and "email" (name in lower case @example.com). People: {", ".join(people)}. Reply with the JSON only.'
    )


KINDS = (edit_prompt, code_prompt, json_prompt)


def greedy_prompts(count: int, seed: int) -> list[str]:
    """`count` prompts, the three kinds in turn, each seeded by (seed, its index)."""
    return [KINDS[i % len(KINDS)](random.Random(f"{seed}-{i}")) for i in range(count)]


# ------------------------------------------------------------------------------------ greedy client


@dataclass
class GreedyRecord(RequestRecord):
    index: int = -1  # the prompt's position, to pair A's and B's answers
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[str, float]] = field(default_factory=list)
    finish_reason: str | None = None


def greedy_body(model: str, content: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def read_chat_stream(connection: SSEConnection, rec: GreedyRecord) -> None:
    """One streamed chat answer, once it has ended -> `rec`: its tokens (ids, logprobs, text), each
    chunk carrying tokens timed when it arrived."""
    error, events = timed_events(connection)
    if error is not None:
        rec.error = error
        return
    usage = None
    for arrived, data in events:
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            rec.error = str(chunk["error"])
            return
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids:
                rec.first = rec.first or arrived
                rec.last = arrived
                rec.chunks += 1
                rec.token_ids += ids
            rec.text += choice.get("delta", {}).get("content") or ""
            rec.logprobs += [(t["token"], t["logprob"]) for t in (choice.get("logprobs") or {}).get("content", [])]
            rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    else:
        rec.error = "the stream did not end with [DONE]"
        return
    if usage is None:
        rec.error = "no usage chunk"
    else:
        rec.tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage["prompt_tokens"])


async def run_greedy_level(
    base_url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int
) -> list[GreedyRecord]:
    """Streams every prompt, `concurrency` at a time, each worker on one keep-alive connection (as
    serve_bench's run_serving_level, keeping each answer's tokens)."""
    url = urllib.parse.urlsplit(base_url)
    host, port = url.hostname, url.port or 80
    loop = asyncio.get_running_loop()
    records: list[GreedyRecord] = []
    queue = list(range(len(prompts)))

    async def worker() -> None:
        connection = None
        while queue:
            i = queue.pop(0)
            request = post_request(host, port, "/v1/chat/completions", greedy_body(model, prompts[i], max_tokens))
            rec = GreedyRecord(sent=time.perf_counter(), index=i)
            records.append(rec)
            try:
                if connection is None or connection.closed:
                    _, connection = await loop.create_connection(SSEConnection, host, port)
                rec.sent = time.perf_counter()
                await connection.send(request)
            except OSError as e:
                rec.error = f"{type(e).__name__}: {e}"
                continue
            read_chat_stream(connection, rec)
        if connection is not None:
            connection.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(records, key=lambda r: r.index)


def first_difference(a: GreedyRecord, b: GreedyRecord) -> str | None:
    """Where B's answer departs from A's (None: the same tokens, logprobs, text and finish)."""
    for name in ("token_ids", "logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            at = next((k for k, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
            return f"{name} differ at token {at} (A {x[at : at + 3]}, B {y[at : at + 3]}; lengths {len(x)}, {len(y)})"
    if a.text != b.text:
        return "the texts differ"
    if (a.finish_reason, a.tokens) != (b.finish_reason, b.tokens):
        return f"finish {a.finish_reason}/{a.tokens} tokens against {b.finish_reason}/{b.tokens}"
    return None


# ------------------------------------------------------------------------------------ servers and counters


@dataclass(frozen=True)
class Counters:
    generated: float
    drafted: float
    accepted: float

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.generated - other.generated, self.drafted - other.drafted, self.accepted - other.accepted)


def read_counters(metrics_url: str) -> Counters:
    return Counters(
        metric(metrics_url, "llm_generation_tokens_total"),
        metric(metrics_url, "llm_spec_draft_tokens_total"),
        metric(metrics_url, "llm_spec_accepted_tokens_total"),
    )


def counters_after(metrics_url: str, before: Counters, generated: int, timeout: float = 10.0) -> Counters:
    """The counters once they include a phase that generated `generated` tokens: the engine publishes
    its stats between steps and when it goes idle, a moment after the last response, one metric after
    another, so they are read until the token count is in and two readings agree."""
    deadline = time.monotonic() + timeout
    last = read_counters(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = read_counters(metrics_url)
        if now.generated - before.generated >= generated and now == last:
            return now
        last = now
    raise RuntimeError(f"{metrics_url}: the counters did not take in {generated} generated tokens in {timeout:.0f} s")


@contextlib.contextmanager
def server_set(name: str, params: dict[str, str], folder: Path):
    """tritonserver and the frontend for one set, as serve_ab.server_set starts them, yielding the
    frontend's URL and tritonserver's metrics URL (B's counters are read there)."""
    from scripts.servers import REPO_ROOT, copy_model_repository, running_servers

    triton_args = {"model_repository": copy_model_repository(folder / f"repository-{name}", **params)} if params else {}
    with running_servers(REPO_ROOT / "artifacts" / "bench-logs", f"-spec-{name}", **triton_args) as (triton, frontend):
        yield frontend.url, triton.metrics_url


# ------------------------------------------------------------------------------------ main


@dataclass
class Phase:
    """One workload and level of one set in one round."""

    tok_s: float
    output_tokens: int
    chunks: int
    counters: Counters
    others: float  # the share of the machine's CPUs that processes not of this benchmark took meanwhile


class CpuWatch:
    """The share of the CPUs that others (processes not of this benchmark, nor of its servers) take."""

    def __init__(self) -> None:
        self.wall, self.ours, self.machine = time.perf_counter(), tree_cpu_s([os.getpid()]), machine_busy_s()

    def others_share(self) -> float:
        wall, ours, machine = time.perf_counter(), tree_cpu_s([os.getpid()]), machine_busy_s()
        foreign = (machine - self.machine) - (ours - self.ours)
        return max(foreign, 0.0) / ((wall - self.wall) * (os.cpu_count() or 1))


def summarize_level(workload: str, c: int, phases: dict[str, list[Phase]]) -> dict:
    comparison = compare([p.tok_s for p in phases["A"]], [p.tok_s for p in phases["B"]])
    b = phases["B"]
    drafted = sum(p.counters.drafted for p in b)
    accepted = sum(p.counters.accepted for p in b)
    output = sum(p.output_tokens for p in b)

    def per_chunk(ps: list[Phase]) -> float:
        return round(sum(p.output_tokens for p in ps) / max(1, sum(p.chunks for p in ps)), 3)

    goal = GOALS.get((workload, c))
    all_others = [p.others for ps in phases.values() for p in ps]
    return {
        **asdict(comparison),
        "acceptance": round(accepted / drafted, 3) if drafted else None,
        "drafted_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "accepted_per_output_token": round(accepted / output, 3) if output else None,
        "b_drafted_per_output_token": round(drafted / output, 3) if output else None,
        "tokens_per_chunk": {"A": per_chunk(phases["A"]), "B": per_chunk(b)},
        "a_drafted_tokens": int(sum(p.counters.drafted for p in phases["A"])),  # must be 0
        "others_share": [round(min(all_others), 3), round(max(all_others), 3)],
        "goal": goal,
        "goal_met": None if goal is None else comparison.b_over_a >= goal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--param-b", action="append", metavar="KEY=VALUE", help="config.pbtxt parameter of B (after speculative=ngram)"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--requests", type=int, help="requests per workload, level and round (default: greedy 3 per stream, at "
        "least 6; random as bench-serve)"
    )  # fmt: skip
    parser.add_argument("--greedy-max-tokens", type=int, default=128)
    parser.add_argument("--random-max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="of the random workload")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = {"A": {}, "B": SPECULATION | parse_settings(args.param_b)}

    import torch

    from backend.checkpoint import load_checkpoint

    tokenizer = load_checkpoint("smollm2", dtype=torch.float32).tokenizer
    salt = random.SystemRandom().randrange(2**31)
    random_args = SimpleNamespace(model=args.model, max_tokens=args.random_max_tokens, endpoint="completions", seed=0)
    print(f"A: params {params['A']}; B: params {params['B']}; salt {salt}", flush=True)

    def requests(workload: str, c: int) -> int:
        return args.requests or (max(6, 3 * c) if workload == "greedy" else default_requests(c))

    def run_phase(r: int, s: str, workload: str, c: int, prompts: list[str]) -> list[RequestRecord]:
        """Set s's phase of round r: the prompts at concurrency c, printed and kept in `phases`."""
        frontend, metrics_url = urls[s]
        before, watch = read_counters(metrics_url), CpuWatch()
        if workload == "greedy":
            records = sse_client.run(run_greedy_level(frontend, args.model, prompts, args.greedy_max_tokens, c))
        else:
            records = serve_level(random_args, frontend, prompts, c)
        others = watch.others_share()
        result = summarize(c, records)
        if result.errors:
            errors = [rec.error for rec in records if rec.error][:3]
            raise SystemExit(f"set {s}, {workload} c={c}: {result.errors} requests failed: {errors}")
        delta = counters_after(metrics_url, before, result.output_tokens) - before
        phase = Phase(
            round(result.output_tok_s, 2), result.output_tokens, sum(x.chunks for x in records), delta, others
        )
        phases[workload, c][s].append(phase)
        spec = f"; drafted {delta.drafted:.0f}, accepted {delta.accepted:.0f}" if s == "B" else ""
        print(
            f"round {r + 1} {workload} c={c}: {s} {phase.tok_s:.1f} tok/s ({phase.output_tokens} tokens, "
            f"{phase.output_tokens / max(1, phase.chunks):.2f} a chunk{spec}; others {100 * others:.0f}%)",
            flush=True,
        )
        return records

    phases = {(w, c): {s: [] for s in SETS} for w in args.workloads for c in args.concurrency}
    differences: list[str] = []
    compared = 0
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        urls = {s: stack.enter_context(server_set(s, params[s], Path(tmp))) for s in SETS}
        for s in SETS:  # not measured: a fresh server's first requests
            warm_up_serving(random_args, tokenizer, urls[s][0], structured=False)
            sse_client.run(run_greedy_level(urls[s][0], args.model, greedy_prompts(3, -1 - salt), 16, 3))
        for r in range(args.rounds):
            for w, (k, c) in itertools.product(args.workloads, enumerate(args.concurrency)):
                seed = salt + args.seed + 1000 * r + 100 * WORKLOADS.index(w) + k
                if w == "random":
                    prompts = make_prompts(tokenizer, requests(w, c), args.prompt_tokens, seed, seed)
                    for s in round_order(r):
                        run_phase(r, s, w, c, prompts)
                    continue
                prompts = greedy_prompts(requests(w, c), seed)
                answers = {s: run_phase(r, s, w, c, prompts) for s in round_order(r)}
                for a, b in zip(answers["A"], answers["B"], strict=True):
                    compared += 1
                    if (why := first_difference(a, b)) is not None:
                        differences.append(f"round {r + 1} c={c} prompt {a.index}: {why}")
                        print(f"OUTPUTS DIFFER: {differences[-1]}", flush=True)

    levels, problems = {}, []
    for (w, c), by_set in phases.items():
        s = summarize_level(w, c, by_set)
        levels[f"{w}_c{c}"] = s
        goal = "" if s["goal"] is None else f"; goal >= {s['goal']}: {'met' if s['goal_met'] else 'NOT met'}"
        print(
            f"{w} c={c}: A {s['a_tok_s']} mean {s['a_mean']}; B {s['b_tok_s']} mean {s['b_mean']}; B / A "
            f"{s['b_over_a']} (B faster in {s['b_faster_rounds']} of {args.rounds}){goal}; acceptance "
            f"{s['acceptance']} ({s['accepted_tokens']} of {s['drafted_tokens']} drafted), accepted per output token "
            f"{s['accepted_per_output_token']}, tokens a chunk A {s['tokens_per_chunk']['A']} B "
            f"{s['tokens_per_chunk']['B']}; others {100 * s['others_share'][0]:.0f}-{100 * s['others_share'][1]:.0f}%",
            flush=True,
        )
        if s["a_drafted_tokens"]:
            problems.append(f"{w} c={c}: A drafted {s['a_drafted_tokens']} tokens with speculation off")
    if "greedy" in args.workloads:
        print(f"greedy answers compared token by token: {compared}, differing: {len(differences)}", flush=True)
    problems = differences + problems
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "params": params,
                "rounds": args.rounds,
                "salt": salt,
                "levels": levels,
                "greedy_compared": compared,
                "greedy_differing": len(differences),
                "problems": problems,
            }
        )
    )
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
