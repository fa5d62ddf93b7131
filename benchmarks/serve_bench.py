"""`make bench-serve`: OpenAI-level streaming load on the frontend, and the same load on the engine in-process.

Workload (the same both ways): seeded prompts of exactly --prompt-tokens tokens (single-token words),
each one different (so prefix caching cannot make later requests look instant) and, by default,
salted per run in their first words (so a `make serve` that stays up does not find the last run's
prompts in its prefix cache), max_tokens fixed with ignore_eos, default sampling (temperature 1),
at concurrency 1, 8 and 32 (a finished request's slot is refilled at once).

(a) serving: streaming /v1/completions (or /v1/chat/completions with --endpoint chat) through
    keep-alive HTTP/1.1 connections (benchmarks/sse_client.py, a client that keeps the bytes and
    parses each stream once it ended, so it takes little of the servers' CPU) against the frontend,
    i.e. HTTP + SSE, the frontend, tritonclient gRPC
    streaming, tritonserver and the decoupled Python backend. Without --url it starts its own
    tritonserver and frontend on free loopback ports (scripts/servers.py).
(b) in-process: backend.engine.LLMEngine(EngineConfig()) driven by `step()` in this process (the
    engine settings of model_repository's config.pbtxt are EngineConfig's defaults).
(c) the peer: transformers `generate` on the same fp32 weights and the same prompt tokens (the first
    round's), in static batches of `concurrency` requests (greedy, exactly max_tokens each), output
    tok/s only (--skip-peer leaves it out), once the servers have stopped.
(d) with --perf-analyzer: perf_analyzer --streaming (Triton's C++ client) straight on tritonserver's
    gRPC endpoint, after (b) in each round, on prompts of its own: perf_analyzer / in-process is what
    tritonserver and the Python backend cost, serving / perf_analyzer what the frontend adds.

(a) and (b) take turns: each of --rounds rounds runs every level served and then in-process, on
prompts of its own. This machine's speed drifts by more than the path costs (the same in-process
step measured 23 and 16 ms a minute apart), so the two paths are compared level by level, seconds
apart, rather than one whole run after the other. The servers stay up, idle, while (b) runs; the CPU
they take meanwhile is printed (it is what (b) shares the cores with). Each figure is all rounds
together (their durations added up, latencies pooled), and the ratios are printed per round too.

Per request: TTFT = first token - send; ITL = (last token - first token) / (tokens - 1) (the
definitions genai-perf uses); output tokens/s = all output tokens / (last token of the run - first
send). Serving counts output tokens from the usage chunk (stream_options.include_usage) and
cross-checks them with the number of streamed chunks (one per token) and, like genai-perf does, with
re-tokenizing the streamed text. The ratio serving / in-process of output tokens/s is the cost of
the HTTP + gRPC + Triton path (target: >= 0.9 at concurrency 8).

--structured (`make bench-structured`): each serving level runs twice in the same run, first without a
constraint, then with a json_schema response_format (an array of at least 20 person objects, so every
output is still cut at max_tokens and both runs produce the same number of tokens) on fresh prompts;
it prints constrained / unconstrained output tok/s (goal >= 0.85 at concurrency 8). One constrained
request before the measurement compiles the schema (compiled grammars are cached by schema).

Servers, engine and client all share the machine. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sse_client
from benchmarks.sse_client import SSEConnection, post_request, timed_events
from scripts import perf_tools
from scripts.perf_tools import percentile

# Common English words; those that are one token with a leading space make the prompts, so each
# prompt is exactly --prompt-tokens tokens.
WORDS = """the of and to in is was for on that with as by at from his her he she it they we you an be
this which or had are but not have were one all their has been there who would will more when if no
out so said what up its about into than them can only other new some could time these two may then do
first any like now my over such our man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little state
good very make world still own see men work long here get both between life being under never day
same another know while last might us great old year off come since against go came right used take
three house water river stone light quick brown fox jumps lazy dog market signal garden orbit paper
window silver echo forest number winter copper ladder candle harbor mountain village teacher doctor
engine kitchen bridge island music letter summer station journey morning evening garden story season
field circle castle planet ocean valley desert thunder shadow mirror pocket bottle blanket""".split()


SALT_WORDS = 4  # about 2e9 combinations: another run's prompts never share this first block


@dataclass
class RequestRecord:
    sent: float
    first: float | None = None  # first token (first chunk carrying a choice)
    last: float | None = None  # last token
    tokens: int = 0  # from usage (serving) or the engine's outputs (in-process)
    chunks: int = 0  # chunks carrying a choice (serving: one per engine step = one per token)
    text_chunks: int = 0  # chunks whose text is not empty (what genai-perf keeps)
    text: str = ""
    prompt_tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    seconds: float
    output_tok_s: float
    request_s: float
    ttft_ms_p50: float
    ttft_ms_p95: float
    itl_ms_p50: float
    itl_ms_p95: float
    latency_ms_p50: float
    extra: dict = field(default_factory=dict)


def summarize(concurrency: int, records: list[RequestRecord]) -> LevelResult:
    return summarize_rounds(concurrency, [records])


def summarize_rounds(concurrency: int, rounds: list[list[RequestRecord]]) -> LevelResult:
    """One level over several rounds of it: the rounds' durations add up (each from its first send to
    its last token; what ran between rounds is not counted), latencies are pooled."""
    records = [r for records in rounds for r in records]
    ok = [r for r in records if r.error is None and r.first is not None]
    seconds = sum(max((r.last or r.sent) for r in rs) - min(r.sent for r in rs) for rs in rounds if rs)
    tokens = sum(r.tokens for r in ok)
    ttft = [(r.first - r.sent) * 1e3 for r in ok]
    itl = [(r.last - r.first) * 1e3 / (r.tokens - 1) for r in ok if r.tokens > 1]
    latency = [(r.last - r.sent) * 1e3 for r in ok]
    return LevelResult(
        concurrency,
        len(records),
        len(records) - len(ok),
        tokens,
        round(seconds, 3),
        tokens / seconds,
        len(ok) / seconds,
        percentile(ttft, 50),
        percentile(ttft, 95),
        percentile(itl, 50),
        percentile(itl, 95),
        percentile(latency, 50),
    )


# ------------------------------------------------------------------------------------------ workload


def single_token_words(tokenizer) -> list[str]:
    words = sorted({w for w in WORDS if len(tokenizer.encode(" " + w)) == 1})
    if len(words) < 50:
        raise RuntimeError(f"only {len(words)} single-token words for this tokenizer")
    return words


def make_prompts(tokenizer, count: int, num_tokens: int, seed: int, salt: int | None = None) -> list[str]:
    """`count` different prompt texts of exactly `num_tokens` tokens each, seeded.

    With `salt`, the first SALT_WORDS words come from it instead: a server that stays up between
    runs (`make serve`) then finds none of an earlier run's prompts in its prefix cache (a cached
    prompt would show a TTFT without prefill); the other words stay fixed by `seed`."""
    words = single_token_words(tokenizer)
    rng = random.Random(seed)
    salt_rng = random.Random(salt)
    prompts = []
    for _ in range(count):
        chosen = [rng.choice(words) for _ in range(num_tokens)]
        if salt is not None:
            chosen[:SALT_WORDS] = [salt_rng.choice(words) for _ in range(min(SALT_WORDS, num_tokens))]
        text = "".join(" " + w for w in chosen)
        n = len(tokenizer.encode(text))
        if n != num_tokens:  # byte-level BPE splits on spaces, so this does not happen; say so if it does
            raise RuntimeError(f"prompt is {n} tokens, not {num_tokens}")
        prompts.append(text)
    return prompts


def chat_prompt_text(tokenizer, content: str) -> str:
    """What the frontend sends to Triton for one user message (the model's chat template)."""
    import jinja2

    env = jinja2.Environment(autoescape=False, trim_blocks=False, keep_trailing_newline=True)
    return env.from_string(tokenizer.chat_template).render(
        messages=[{"role": "user", "content": content}],
        add_generation_prompt=True,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )


# --structured: long enough that max_tokens always cuts it, so both runs make the same number of tokens.
PEOPLE_SCHEMA = {
    "type": "array",
    "minItems": 20,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
STRUCTURED_BODY = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": PEOPLE_SCHEMA}}
}


def default_requests(concurrency: int) -> int:
    return max(4, 2 * concurrency)


# ------------------------------------------------------------------------------------------ serving


def read_stream(connection: SSEConnection, rec: RequestRecord, chat: bool) -> None:
    """One streamed response, once it has ended -> `rec` (each token timed when its event arrived)."""
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
        if chunk.get("usage"):
            usage = chunk["usage"]
        choices = chunk.get("choices") or []
        if not choices:
            continue
        delta = choices[0].get("delta", {}) if chat else choices[0]
        if chat and "role" in delta:
            continue  # the role chunk carries no token
        if rec.first is None:
            rec.first = arrived
        rec.last = arrived
        rec.chunks += 1
        text = delta.get("content" if chat else "text") or ""
        if text:
            rec.text_chunks += 1
            rec.text += text
    else:
        rec.error = "the stream did not end with [DONE]"
        return
    if usage is None:
        rec.error = "no usage chunk"
    else:
        rec.tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage["prompt_tokens"])


async def run_serving_level(
    base_url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    concurrency: int,
    chat: bool,
    extra_body: dict | None = None,
) -> list[RequestRecord]:
    """Streams every prompt, `concurrency` at a time, each worker on one keep-alive connection
    (benchmarks/sse_client.py: the client takes as little of the servers' CPU as it can)."""
    url = urllib.parse.urlsplit(base_url)
    host, port = url.hostname, url.port or 80
    path = "/v1/chat/completions" if chat else "/v1/completions"
    records: list[RequestRecord] = []
    queue = list(range(len(prompts)))
    loop = asyncio.get_running_loop()

    def payload(i: int) -> dict:
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra_body or {}),
        }
        if chat:
            body["messages"] = [{"role": "user", "content": prompts[i]}]
        else:
            body["prompt"] = prompts[i]
        return body

    async def worker() -> None:
        connection = None
        while queue:
            request = post_request(host, port, path, payload(queue.pop(0)))
            rec = RequestRecord(sent=time.perf_counter())
            records.append(rec)
            try:
                if connection is None or connection.closed:
                    _, connection = await loop.create_connection(SSEConnection, host, port)
                rec.sent = time.perf_counter()
                await connection.send(request)
            except OSError as e:
                rec.error = f"{type(e).__name__}: {e}"
                continue
            read_stream(connection, rec, chat)
        if connection is not None:
            connection.transport.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def serving_checks(records: list[RequestRecord], tokenizer, max_tokens: int, prompt_tokens: set[int]) -> dict:
    """Token counts three ways: usage, chunks, re-tokenized text (genai-perf's way)."""
    ok = [r for r in records if r.error is None]
    retok = [len(tokenizer.encode(r.text)) for r in ok]
    return {
        "usage_tokens_mean": sum(r.tokens for r in ok) / max(len(ok), 1),
        "usage_equals_max_tokens": all(r.tokens == max_tokens for r in ok),
        "chunks_equal_usage": all(r.chunks == r.tokens for r in ok),
        "nonempty_text_chunks_mean": sum(r.text_chunks for r in ok) / max(len(ok), 1),
        "retokenized_tokens_mean": sum(retok) / max(len(retok), 1),
        "prompt_tokens_as_sent": all(r.prompt_tokens in prompt_tokens for r in ok),
        "errors": [r.error for r in records if r.error is not None][:3],
    }


@contextlib.contextmanager
def frontend_url(args) -> Iterator[tuple[str, dict[str, int], str]]:
    """The frontend to load, the pids of the servers behind it and tritonserver's gRPC host:port: --url
    (no pids; --triton-url), or our own tritonserver and frontend on free ports, stopped on exit."""
    if args.url is not None:
        yield args.url.rstrip("/").removesuffix("/v1"), {}, args.triton_url or perf_tools.triton_grpc_url()
        return
    from scripts.servers import REPO_ROOT, Frontend, TritonServer, free_port
    from scripts.stub_supervisor import stub_processes

    logs = REPO_ROOT / "artifacts" / "bench-logs"
    logs.mkdir(parents=True, exist_ok=True)
    print("starting tritonserver and the frontend on free ports ...", flush=True)
    triton = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    triton.start(log_path=logs / "tritonserver.log")
    try:
        frontend = Frontend(triton.grpc_url, port=free_port()).start(log_path=logs / "frontend.log")
    except BaseException:
        triton.stop()
        raise
    pids = {"tritonserver": triton.proc.pid, "frontend": frontend.proc.pid}
    pids.update({f"stub {pid}": pid for pid in stub_processes(triton.proc.pid)})
    try:
        yield frontend.url.rstrip("/").removesuffix("/v1"), pids, triton.grpc_url
    finally:
        frontend.stop()
        triton.stop()


def process_cpu_s(pids: dict[str, int]) -> float:
    """User + system CPU seconds of these processes (all their threads) so far; 0 for one that ended."""
    total = 0
    for pid in pids.values():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def warm_up_serving(args, tokenizer, base_url: str, structured: bool) -> None:
    """Not measured: the first requests of a fresh server (and the schema's compilation)."""
    chat = args.endpoint == "chat"
    warm = make_prompts(tokenizer, 2, 16, seed=args.seed + 1000)
    sse_client.run(run_serving_level(base_url, args.model, warm, 4, 2, chat))
    if structured:  # compiled grammars are cached by schema
        sse_client.run(run_serving_level(base_url, args.model, warm[:1], 4, 1, chat, STRUCTURED_BODY))


def serve_level(args, base_url: str, prompts: list[str], c: int, extra_body: dict | None = None) -> list[RequestRecord]:
    return sse_client.run(
        run_serving_level(base_url, args.model, prompts, args.max_tokens, c, args.endpoint == "chat", extra_body)
    )


def perf_analyzer_level(args, grpc_url: str, engine_prompts: list[str], c: int, work_dir: Path) -> list[RequestRecord]:
    """The level through perf_analyzer --streaming straight on tritonserver (Triton's C++ client, no
    frontend, no HTTP): each prompt once, as the text the engine gets, `c` at a time."""
    params = json.dumps({"max_tokens": args.max_tokens, "ignore_eos": True})
    input_data = work_dir / f"input_c{c}.json"
    # Given c prompts more than it sends: one it sent past the count must not find its prompt cached.
    data = [{"text_input": [p], "sampling_params": [params]} for p in engine_prompts]
    input_data.write_text(json.dumps({"data": data}))
    export = work_dir / f"export_c{c}.json"
    cmd = perf_tools.perf_analyzer_command(args.model, grpc_url, c, len(engine_prompts) - c, input_data, export)
    export.unlink(missing_ok=True)  # (perf_analyzer refuses to overwrite one)
    result = subprocess.run(cmd, env=perf_tools.tools_env(), capture_output=True, text=True, check=False)
    # (Not retried on an empty export, which perf_analyzer 2.50 left once in many runs: a second run would
    # find its prompts cached.)
    if result.returncode != 0 or not export.is_file() or export.stat().st_size == 0:
        raise RuntimeError(f"perf_analyzer failed at concurrency {c}:\n{result.stdout}{result.stderr}")
    ((_, requests),) = perf_tools.exported_requests(export)
    return [
        RequestRecord(
            sent=r.sent_ns / 1e9, first=r.responses_ns[0] / 1e9, last=r.responses_ns[-1] / 1e9, tokens=r.tokens
        )
        for r in requests
    ]


# ------------------------------------------------------------------------------------------ in-process


def run_inprocess_level(
    engine, prompt_ids: list[list[int]], max_tokens: int, concurrency: int, params=None
) -> list[RequestRecord]:
    """The prompts through the engine alone, `concurrency` in flight, each finished one replaced by the
    next; `params` (SamplingParams) default to `max_tokens` tokens with ignore_eos."""
    from protocol import SamplingParams, StepOutput

    params = params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    pending = list(range(len(prompt_ids)))
    records: dict[str, RequestRecord] = {}
    active = 0

    def submit(i: int) -> None:
        rid = f"bench-{i}-{time.monotonic_ns()}"
        records[rid] = RequestRecord(sent=time.perf_counter(), prompt_tokens=len(prompt_ids[i]))
        engine.add_request(engine.make_request(rid, prompt_ids[i], params))

    while pending and active < concurrency:
        submit(pending.pop(0))
        active += 1
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if not isinstance(out, StepOutput):
                records[out.request_id].error = str(out)
                active -= 1
                continue
            rec = records[out.request_id]
            if out.token_ids:
                rec.first = rec.first or now
                rec.last = now
                rec.tokens += len(out.token_ids)
                rec.chunks += 1
            if out.request_finished:
                active -= 1
                if pending:
                    submit(pending.pop(0))
                    active += 1
    return list(records.values())


def inprocess_engine(checkpoint, seed: int):
    """LLMEngine with the served engine's settings (EngineConfig's defaults are config.pbtxt's), warmed up."""
    from backend.config import EngineConfig
    from backend.engine import LLMEngine

    engine = LLMEngine(EngineConfig(), checkpoint=checkpoint)
    warm = [checkpoint.tokenizer.encode(p) for p in make_prompts(checkpoint.tokenizer, 2, 16, seed=seed + 1000)]
    run_inprocess_level(engine, warm, 4, 2)  # not measured
    return engine


def run_peer(checkpoint, workloads: dict[int, list[list[int]]], max_tokens: int) -> dict[int, float]:
    """transformers generate, static batches of c: output tok/s per concurrency c."""
    from benchmarks.engine_bench import run_hf
    from benchmarks.hf_peer import build_hf_model

    model = build_hf_model(checkpoint.config, checkpoint.state_dict)
    run_hf(model, workloads[min(workloads)][:1], [4], 1)  # warm-up, not measured
    results = {}
    for c, prompt_ids in workloads.items():
        tokens, seconds = run_hf(model, prompt_ids, [max_tokens] * len(prompt_ids), c)
        results[c] = tokens / seconds
        print(
            f"{'transformers':>10} c={c:<3} {len(prompt_ids)} requests: {tokens} tokens in {seconds:.1f} s = "
            f"{results[c]:.1f} tok/s",
            flush=True,
        )
    return results


# ------------------------------------------------------------------------------------------ main


def print_level(kind: str, r: LevelResult) -> None:
    print(
        f"{kind:>10} c={r.concurrency:<3} {r.requests} requests ({r.errors} failed): {r.output_tokens} tokens in "
        f"{r.seconds:.1f} s = {r.output_tok_s:.1f} tok/s; TTFT p50 {r.ttft_ms_p50:.0f} p95 {r.ttft_ms_p95:.0f} ms; "
        f"ITL p50 {r.itl_ms_p50:.1f} p95 {r.itl_ms_p95:.1f} ms",
        flush=True,
    )


def print_ratios(names: tuple[str, str], a: dict[int, LevelResult], b: dict[int, LevelResult]) -> dict[int, float]:
    """Per concurrency in both: a's / b's output tok/s, printed as a markdown table with the p50 latencies."""
    ratios = {c: a[c].output_tok_s / b[c].output_tok_s for c in a if c in b}
    if ratios:
        x, y = names
        print(
            f"\n| concurrency | {x} tok/s | {y} tok/s | ratio | {x} TTFT p50 ms | {y} TTFT p50 ms "
            f"| {x} ITL p50 ms | {y} ITL p50 ms |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c, ratio in ratios.items():
            print(
                f"| {c} | {a[c].output_tok_s:.1f} | {b[c].output_tok_s:.1f} | {ratio:.2f} | {a[c].ttft_ms_p50:.0f} | "
                f"{b[c].ttft_ms_p50:.0f} | {a[c].itl_ms_p50:.1f} | {b[c].itl_ms_p50:.1f} |"
            )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running frontend (http://127.0.0.1:9000); default: start our own servers")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, help="requests per concurrency level (default max(4, 2 x concurrency))")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt words")
    parser.add_argument(
        "--salt",
        type=int,
        help=f"seed of each prompt's first {SALT_WORDS} words; default: random per run "
        "(so a long-running server's prefix cache holds none of them); -1: no salt",
    )
    parser.add_argument(
        "--structured",
        action="store_true",
        help="also run each serving level with a json_schema "
        "constraint and print the constrained / unconstrained ratio",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="each round runs every level served and then in-process, on fresh prompts; the ratios "
        "compare the two paths minutes apart at most, as the machine's speed drifts (default 3)",
    )
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-inprocess", action="store_true")
    parser.add_argument("--skip-peer", action="store_true", help="leave out transformers generate")
    parser.add_argument(
        "--perf-analyzer",
        action="store_true",
        help="each round also runs every level through perf_analyzer straight on tritonserver (Triton's C++ "
        "client: no frontend, no HTTP) on prompts of its own, and prints its ratio to in-process (the tools "
        "are installed into .tools/ on first use)",
    )
    parser.add_argument(
        "--triton-url", help="with --url and --perf-analyzer: tritonserver's gRPC host:port (default 127.0.0.1:8001)"
    )
    args = parser.parse_args()

    import torch

    from backend.checkpoint import load_checkpoint

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.endpoint}, prompts "
        f"{args.prompt_tokens} tokens, max_tokens {args.max_tokens} (ignore_eos), {args.rounds} rounds",
        flush=True,
    )
    checkpoint = load_checkpoint("smollm2", dtype=torch.float32)
    tok = checkpoint.tokenizer
    # Different prompts for every request of every level and round, the same ones for both paths.
    salt = args.salt if args.salt is not None else random.SystemRandom().randrange(2**31)
    salt = None if salt < 0 else salt
    print(
        f"prompt seed {args.seed}, salt {salt} (--salt {salt if salt is not None else -1} repeats these prompts)",
        flush=True,
    )

    def prompts(c: int, k: int, r: int, offset: int = 0, spare: int = 0) -> list[str]:
        seed = args.seed + offset + k + 1000 * r
        count = (args.requests or default_requests(c)) + spare
        return make_prompts(tok, count, args.prompt_tokens, seed, None if salt is None else salt + seed)

    def engine_texts(texts: list[str]) -> list[str]:
        """What the frontend hands the engine for these prompts."""
        return [chat_prompt_text(tok, t) for t in texts] if args.endpoint == "chat" else texts

    def engine_ids(texts: list[str]) -> list[list[int]]:
        return [tok.encode(t) for t in engine_texts(texts)]

    levels = args.concurrency
    serving_runs: dict[int, list[list[RequestRecord]]] = defaultdict(list)
    constrained_runs: dict[int, list[list[RequestRecord]]] = defaultdict(list)
    inproc_runs: dict[int, list[list[RequestRecord]]] = defaultdict(list)
    triton_runs: dict[int, list[list[RequestRecord]]] = defaultdict(list)
    expected_prompt_tokens: set[int] = set()
    idle_servers_cpu_s = inproc_s = 0.0
    with contextlib.ExitStack() as stack:
        base_url, server_pids, grpc_url = (
            (None, {}, None) if args.skip_serving else stack.enter_context(frontend_url(args))
        )
        if base_url is not None:
            warm_up_serving(args, tok, base_url, args.structured)
        pa_dir = None
        if args.perf_analyzer and grpc_url is not None:
            perf_tools.install(tokenizer=False)
            pa_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="serve_bench_pa_")))
        engine = None if args.skip_inprocess else inprocess_engine(checkpoint, args.seed)
        for r in range(args.rounds):
            for k, c in enumerate(levels):
                texts = prompts(c, k, r)
                ids = engine_ids(texts)
                expected_prompt_tokens.update(len(i) for i in ids)
                line = f"round {r + 1} c={c}:"
                if base_url is not None:
                    records = serve_level(args, base_url, texts, c)
                    serving_runs[c].append(records)
                    line += f" serving {summarize(c, records).output_tok_s:.1f} tok/s"
                    if args.structured:  # fresh prompts: the constrained run finds none of them cached
                        records = serve_level(args, base_url, prompts(c, k, r, offset=500), c, STRUCTURED_BODY)
                        constrained_runs[c].append(records)
                        line += f", json_schema {summarize(c, records).output_tok_s:.1f} tok/s"
                if engine is not None:
                    cpu_before, start = process_cpu_s(server_pids), time.perf_counter()
                    records = run_inprocess_level(engine, ids, args.max_tokens, c)
                    idle_servers_cpu_s += process_cpu_s(server_pids) - cpu_before
                    inproc_s += time.perf_counter() - start
                    inproc_runs[c].append(records)
                    line += f", in-process {summarize(c, records).output_tok_s:.1f} tok/s"
                    if base_url is not None:
                        ratio = summarize(c, serving_runs[c][-1]).output_tok_s / summarize(c, records).output_tok_s
                        line += f": ratio {ratio:.2f}"
                if pa_dir is not None:  # fresh prompts (and c spare ones): none of them is cached
                    texts = prompts(c, k, r, offset=700, spare=c)
                    records = perf_analyzer_level(args, grpc_url, engine_texts(texts), c, pa_dir)
                    triton_runs[c].append(records)
                    line += f"; perf_analyzer {summarize(c, records).output_tok_s:.1f} tok/s"
                print(line, flush=True)
    del engine

    def pooled(runs: dict[int, list[list[RequestRecord]]], kind: str) -> dict[int, LevelResult]:
        out = {c: summarize_rounds(c, rounds) for c, rounds in runs.items()}
        for res in out.values():
            print_level(kind, res)
        return out

    print(f"\nall {args.rounds} rounds together:")
    serving = pooled(serving_runs, "serving")
    constrained = pooled(constrained_runs, "json_schema")
    inproc = pooled(inproc_runs, "in-process")
    triton = pooled(triton_runs, "perf_analyzer")
    for c, runs in serving_runs.items():
        serving[c].extra = serving_checks([r for rs in runs for r in rs], tok, args.max_tokens, expected_prompt_tokens)
    for c, runs in constrained_runs.items():
        constrained[c].extra = serving_checks(
            [r for rs in runs for r in rs], tok, args.max_tokens, expected_prompt_tokens
        )
    idle_ms_per_s = 1e3 * idle_servers_cpu_s / inproc_s if inproc_s and server_pids else None
    if idle_ms_per_s is not None:
        print(f"the idle servers took {idle_ms_per_s:.1f} ms of CPU per second while the in-process levels ran")
    peer = (
        {}
        if args.skip_peer
        else run_peer(checkpoint, {c: engine_ids(prompts(c, k, 0)) for k, c in enumerate(levels)}, args.max_tokens)
    )

    ratios = print_ratios(("serving", "in-process"), serving, inproc)
    by_round = {
        c: [
            summarize(c, s).output_tok_s / summarize(c, i).output_tok_s for s, i in zip(serving_runs[c], inproc_runs[c])
        ]
        for c in ratios
    }
    for c, values in by_round.items():
        print(f"c={c}: serving / in-process by round: " + ", ".join(f"{v:.2f}" for v in values))
    triton_ratios = print_ratios(("perf_analyzer", "in-process"), triton, inproc)
    for c in triton_ratios:
        if c in serving:
            print(f"c={c}: serving / perf_analyzer {serving[c].output_tok_s / triton[c].output_tok_s:.2f}")
    peer_ratios = {c: serving[c].output_tok_s / peer[c] for c in serving if c in peer}
    for c, ratio in peer_ratios.items():
        print(f"c={c}: serving {serving[c].output_tok_s:.1f} tok/s / transformers {peer[c]:.1f} = {ratio:.2f}x")
    structured = print_ratios(("json_schema", "unconstrained"), constrained, serving)
    checks = {c: r.extra for c, r in serving.items()}
    checks.update({f"{c}-constrained": r.extra for c, r in constrained.items()})
    for c, ch in checks.items():
        if not (ch["usage_equals_max_tokens"] and ch["chunks_equal_usage"]) or ch["errors"]:
            print(f"WARNING c={c}: token counts disagree or requests failed: {ch}", flush=True)

    def level_dict(r: LevelResult) -> dict:
        d = asdict(r)
        d.pop("extra")
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()}

    print(
        json.dumps(
            {
                "endpoint": args.endpoint,
                "seed": args.seed,
                "salt": salt,
                "rounds": args.rounds,
                "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens,
                "serving": {str(c): level_dict(r) for c, r in serving.items()},
                "inprocess": {str(c): level_dict(r) for c, r in inproc.items()},
                "ratio": {str(c): round(v, 3) for c, v in ratios.items()},
                "ratio_by_round": {str(c): [round(v, 3) for v in vs] for c, vs in by_round.items()},
                "ratio_c8": round(ratios[8], 3) if 8 in ratios else None,
                "perf_analyzer": {str(c): level_dict(r) for c, r in triton.items()},
                "perf_analyzer_ratio": {str(c): round(v, 3) for c, v in triton_ratios.items()},
                "idle_servers_cpu_ms_per_s_during_inprocess": None
                if idle_ms_per_s is None
                else round(idle_ms_per_s, 2),
                "transformers_tok_s": {str(c): round(v, 2) for c, v in peer.items()},
                "serving_over_transformers": {str(c): round(v, 3) for c, v in peer_ratios.items()},
                "constrained": {str(c): level_dict(r) for c, r in constrained.items()},
                "structured_ratio": {str(c): round(v, 3) for c, v in structured.items()},
                "token_checks": {
                    str(c): {k: (round(v, 2) if isinstance(v, float) else v) for k, v in ch.items()}
                    for c, ch in checks.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
