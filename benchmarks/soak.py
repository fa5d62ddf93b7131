"""`make soak`: mixed traffic against the real servers for N minutes, then one line of JSON.

    python benchmarks/soak.py --minutes 10 --concurrency 8      # starts tritonserver + frontend itself
    python benchmarks/soak.py --url http://127.0.0.1:9000 --triton-metrics http://127.0.0.1:8002/metrics

Each worker loops over random requests: completions and chat, streamed and not, n 1-3, logprobs on
and off, stop strings, include_usage; in four requests of ten a random one to three of the other
request fields (logit_bias, allowed_token_ids, bad_words, min_tokens, the penalties, top_k / top_p /
min_p, stop_token_ids, include_stop_str_in_output, skip_special_tokens false, ignore_eos,
truncate_prompt_tokens, return_token_ids, a JSON or choice constraint, echo, chat tools with
tool_choice auto, required or named); completions with one to three prompts (one admission group);
streams the client drops after a few chunks; and now and then an oversized body (expects 413) or an
invalid one (expects 400). Every stream is checked as a client
would: well-formed SSE ending in [DONE], each choice finishing once, usage equal to the tokens seen,
logprob tokens joining to the text. At the end, once the engine is idle: KV blocks in use (must be 0)
and the frontend's integrity-violation counter (must not move).

Printed: {"requests", "ok", "expected_errors", "errors" (by kind: must be empty), "error_examples",
"violations", "violation_examples",
"kv_blocks_in_use", "rss_mb": {"frontend": [start, end], "stub": [start, end]}, ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.servers import DEFAULT_MODEL, REPO_ROOT, Frontend, TritonServer, free_port
from scripts.stub_supervisor import stub_processes

PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "List three colors:",
    "def add(a, b):",
    "Write a haiku about the sea.",
    "1, 2, 3,",
]
STOPS = [None, ["\n"], [".", "!"], ["the"]]
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Looks a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
VOCAB = 49152  # the default model's; ids below it are all valid
EOS = 2  # <|im_end|>, the default model's EOS


def sampling_extras(rng: random.Random, chat: bool, max_tokens: int) -> tuple[dict[str, Any], bool]:
    """A random few of the engine's other request fields, so that they meet each other (and n, logprobs,
    stops, disconnects) under load: the sampler's processors, structured output, batched prompts.
    Returns (fields, whether logprob tokens must still join to the text: a stop token's text and
    echo's prompt are the documented exceptions)."""
    choices: dict[str, Any] = {
        "logit_bias": lambda: {str(rng.randrange(VOCAB)): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))},
        "allowed_token_ids": lambda: rng.sample(range(VOCAB), rng.randint(1, 40)) + [EOS] * rng.randint(0, 1),
        "bad_words": lambda: rng.sample(["the", " the", "Paris", "is a", "colors", "1, 2"], rng.randint(1, 3)),
        "min_tokens": lambda: rng.randint(0, max_tokens),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.uniform(-2, 2),
        "repetition_penalty": lambda: rng.uniform(0.5, 2),
        "top_k": lambda: rng.choice([-1, 1, 5, 50]),
        "top_p": lambda: rng.uniform(0.05, 1),
        "min_p": lambda: rng.uniform(0, 0.5),
        "stop_token_ids": lambda: [rng.randrange(VOCAB) for _ in range(3)] + [13],  # 13: a common piece
        "include_stop_str_in_output": lambda: True,
        "skip_special_tokens": lambda: False,
        "ignore_eos": lambda: True,
        "truncate_prompt_tokens": lambda: rng.randint(1, 6),
        "return_token_ids": lambda: True,
        "response_format": lambda: {"type": "json_object"},
        "structured_outputs": lambda: {"choice": ["yes", "no", "maybe not"]},
    }
    if chat:
        choices["tools"] = lambda: rng.choice(
            ["auto", "required", {"type": "function", "function": {"name": "lookup"}}]
        )
    else:
        choices["echo"] = lambda: True
    picked = rng.sample(sorted(choices), rng.randint(1, 3))
    if "response_format" in picked and "structured_outputs" in picked:
        picked.remove("structured_outputs")
    fields = {name: choices[name]() for name in picked}
    if "tools" in fields:  # one function; tool_choice drawn above
        fields["tool_choice"] = fields.pop("tools")
        fields["tools"] = [LOOKUP_TOOL]
        fields.pop("response_format", None)  # (a 400 with a tool_choice that makes a call)
        fields.pop("structured_outputs", None)
    joins = not ({"stop_token_ids", "skip_special_tokens", "echo"} & fields.keys())
    return fields, joins


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    expected_errors: Counter = field(default_factory=Counter)  # 413 / 400 asked for, disconnects
    errors: Counter = field(default_factory=Counter)  # anything else: must stay empty
    violations: list[str] = field(default_factory=list)  # client-side checks of the streams
    error_examples: list[str] = field(default_factory=list)


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as f:
        total = 0.0
        for line in f.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def check_stream(
    events: list[Any], n_choices: int, include_usage: bool, logprobs: bool, chat: bool, stops: bool
) -> list[str]:
    """What a careful client would check in one complete SSE stream; returns what broke."""
    problems = []
    if not events or events[-1] != "[DONE]":
        return ["no [DONE] at the end"]
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    token_texts: dict[int, str] = {}
    finished: set[int] = set()
    usage = None
    for chunk in events[:-1]:
        if "error" in chunk:
            return [f"error event: {chunk['error'].get('message', '')[:120]}"]
        if chunk.get("usage") and not chunk["choices"]:
            usage = chunk["usage"]
        for c in chunk["choices"]:
            i = c["index"]
            if i in finished:
                problems.append(f"choice {i}: a chunk after its finish")
            text = c["delta"].get("content", "") if chat else c["text"]
            texts[i] = texts.get(i, "") + (text or "")
            lp = c.get("logprobs")
            if logprobs and lp is not None:
                if chat:
                    tokens[i] = tokens.get(i, 0) + len(lp["content"])
                else:
                    tokens[i] = tokens.get(i, 0) + len(lp["tokens"])
                    token_texts[i] = token_texts.get(i, "") + "".join(lp["tokens"])
            if c.get("finish_reason"):
                finished.add(i)
    if logprobs and not chat and not stops:  # (a stop string cuts the text, not the tokens)
        problems += [
            f"choice {i}: logprob tokens do not join to the text" for i in texts if token_texts.get(i, "") != texts[i]
        ]
    if finished != set(range(n_choices)):
        problems.append(f"finished choices {sorted(finished)} of {n_choices}")
    if include_usage:
        if usage is None:
            problems.append("no usage chunk")
        elif logprobs and usage["completion_tokens"] != sum(tokens.values()):
            problems.append(f"usage {usage['completion_tokens']} != {sum(tokens.values())} tokens streamed")
    return problems


async def one_request(http: httpx.AsyncClient, model: str, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(
        ["stream", "whole", "chat", "disconnect", "oversized", "invalid"], weights=[40, 20, 20, 12, 3, 5]
    )[0]
    tally.requests += 1
    if kind == "oversized":
        r = await http.post(
            "/v1/completions",
            content=b'{"prompt": "' + b"x" * (9 * 2**20) + b'"}',
            headers={"content-type": "application/json"},
        )
        (tally.expected_errors if r.status_code == 413 else tally.errors)[f"oversized->{r.status_code}"] += 1
        return
    if kind == "invalid":
        r = await http.post("/v1/completions", json={"model": model, "prompt": "x", "temperature": -1})
        (tally.expected_errors if r.status_code == 400 else tally.errors)[f"invalid->{r.status_code}"] += 1
        return
    n = rng.randint(1, 3)
    logprobs = rng.random() < 0.5
    include_usage = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "n": n,
        "max_tokens": rng.randint(4, 48),
        "temperature": 0.8,
        "seed": rng.randint(0, 2**31),
        "stop": rng.choice(STOPS),
    }
    chat = kind == "chat"
    extras, joins = sampling_extras(rng, chat, body["max_tokens"]) if rng.random() < 0.4 else ({}, True)
    body |= extras
    if chat:
        body |= {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "logprobs": logprobs,
            "top_logprobs": 2 if logprobs else None,
        }
        path = "/v1/chat/completions"
    else:
        prompts = rng.sample(PROMPTS, rng.choice([1, 1, 1, 2, 3]))  # several: one admission group
        body |= {"prompt": prompts if len(prompts) > 1 else prompts[0]}
        body |= {"logprobs": rng.choice([0, 2]) if logprobs else None}
        n *= len(prompts)
        path = "/v1/completions"
    stream = kind in ("stream", "disconnect") or (chat and rng.random() < 0.5)
    if not stream:
        r = await http.post(path, json=body)
        if r.status_code == 200 and len(r.json()["choices"]) == n:
            tally.ok += 1
        else:
            tally.errors[f"{kind}->{r.status_code}"] += 1
            tally.error_examples.append(f"{r.status_code} {r.text[:200]} for {json.dumps(body)[:400]}")
        return
    body |= {"stream": True, "stream_options": {"include_usage": include_usage}}
    events: list[Any] = []
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            tally.errors[f"{kind}->{r.status_code}"] += 1
            tally.error_examples.append(f"{r.status_code} {(await r.aread())[:200]!r} for {json.dumps(body)[:400]}")
            return
        drop_after = rng.randint(1, 4) if kind == "disconnect" else None
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if drop_after is not None and len(events) >= drop_after:
                    tally.expected_errors["disconnect"] += 1
                    return  # leaving the block closes the connection: the server must cancel the work
    logprobs = logprobs and not body.get("echo")  # echo's logprobs hold the prompt's tokens too
    problems = check_stream(events, n, include_usage, logprobs, chat, body["stop"] is not None or not joins)
    if problems:
        tally.violations.extend(f"{p} ({json.dumps(body)[:300]})" for p in problems)
    else:
        tally.ok += 1


async def soak(
    url: str,
    metrics_url: str,
    model: str,
    seconds: float,
    concurrency: int,
    seed: int,
    frontend_pid: int | None,
    stub_pid: int | None,
) -> dict[str, Any]:
    tally = Tally()
    violations_before = metric(f"{url}/metrics", "frontend_stream_integrity_violations_total")
    rss_start = {"frontend": rss_mb(frontend_pid), "stub": rss_mb(stub_pid)}
    deadline = time.monotonic() + seconds

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while time.monotonic() < deadline:
                try:
                    await one_request(http, model, rng, tally)
                except httpx.HTTPError as e:
                    tally.errors[f"transport:{type(e).__name__}"] += 1

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    kv_in_use = None
    idle_deadline = time.monotonic() + 60
    while time.monotonic() < idle_deadline:  # cancelled work is freed at the engine's next step
        kv_in_use = metric(metrics_url, "llm_kv_blocks_used")
        if kv_in_use == 0 and metric(metrics_url, "llm_num_running") == 0:
            break
        await asyncio.sleep(0.5)
    return {
        "seconds": seconds,
        "concurrency": concurrency,
        "requests": tally.requests,
        "ok": tally.ok,
        "expected_errors": dict(tally.expected_errors),
        "errors": dict(tally.errors),
        "violations": len(tally.violations)
        + int(metric(f"{url}/metrics", "frontend_stream_integrity_violations_total") - violations_before),
        "violation_examples": tally.violations[:5],
        "error_examples": tally.error_examples[:5],
        "kv_blocks_in_use": kv_in_use,
        "rss_mb": {
            name: [start, rss_mb(pid)] for (name, start), pid in zip(rss_start.items(), (frontend_pid, stub_pid))
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", default=None, help="a running frontend (default: start the servers here)")
    parser.add_argument("--triton-metrics", default=None, help="its Triton's metrics URL (with --url)")
    args = parser.parse_args(argv)
    triton = frontend = None
    try:
        if args.url is None:
            logs = REPO_ROOT / "artifacts" / "soak"
            logs.mkdir(parents=True, exist_ok=True)
            triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
            triton.start(log_path=logs / "tritonserver.log")
            frontend = Frontend(triton.grpc_url, port=free_port())
            frontend.start(log_path=logs / "frontend.log")
            url, metrics_url = frontend.url, triton.metrics_url
            stub = next(iter(stub_processes(triton.proc.pid)), None)
            frontend_pid = frontend.proc.pid
        else:
            url, metrics_url, stub, frontend_pid = args.url.rstrip("/"), args.triton_metrics, None, None
        result = asyncio.run(
            soak(url, metrics_url, DEFAULT_MODEL, args.minutes * 60, args.concurrency, args.seed, frontend_pid, stub)
        )
    finally:
        if frontend is not None:
            frontend.stop()
        if triton is not None:
            triton.stop()
    print(json.dumps(result))
    clean = not result["errors"] and result["violations"] == 0 and result["kv_blocks_in_use"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
